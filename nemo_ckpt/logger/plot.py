"""Curves of a run: the logged scalars of all its versions on one step axis (matplotlib, no display needed)."""

from pathlib import Path

from nemo_ckpt.logger.runs import join, read_scalars, version_dirs

DEFAULT_METRICS = ("reduced_train_loss", "val_loss", "lr", "tokens_per_sec")


def plot_run(
    run_dir: str | Path, metrics: list[str] | tuple[str, ...] = DEFAULT_METRICS, out: str | Path | None = None
) -> tuple[Path, dict[str, dict[int, float]]]:
    """Plot `metrics` of every version of `run_dir` (`<log_dir>/<name>`) joined along the step axis, one panel per
    metric, a dotted line where each resumed version starts; write a PNG to `out` (default
    `<run_dir>/curves.png`). Returns the file and the plotted data, `{metric: {step: value}}`. Metrics the run did
    not log are left out; none at all is an error naming the ones it has."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    run_dir = Path(run_dir)
    versions = [read_scalars(version) for version in (version_dirs(run_dir) if run_dir.is_dir() else [])]
    versions = [scalars for scalars in versions if scalars]
    if not versions:
        raise FileNotFoundError(f"{run_dir} holds no logs (TensorBoard events or metrics.csv); give <log_dir>/<name>")
    scalars = join(versions)
    data = {metric: scalars[metric] for metric in metrics if scalars.get(metric)}
    if not data:
        raise ValueError(f"{run_dir} logged none of {list(metrics)}; it has {sorted(scalars)} (use --metrics)")
    resumes = [min(min(values) for values in version.values() if values) for version in versions[1:]]

    figure, axes = plt.subplots(len(data), 1, sharex=True, figsize=(8, 2.6 * len(data)), squeeze=False)
    for ax, (metric, values) in zip(axes[:, 0], data.items()):
        ax.plot(list(values), list(values.values()), marker="." if len(values) < 50 else None)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        for step in resumes:
            ax.axvline(step, color="grey", linestyle=":", linewidth=1)
    axes[-1, 0].set_xlabel("step")
    title = f"{run_dir.name}: {len(versions)} version(s)" + (f", resumed at steps {resumes}" if resumes else "")
    axes[0, 0].set_title(title)
    figure.tight_layout()
    out = Path(out) if out is not None else run_dir / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out, data
