"""Save and load strategies: interfaces (`base`), formats (`torch`, `common`, `zarr`), the default of each
format (`defaults`) and wrappers that change how the work is done (`fully_parallel`, async)."""
