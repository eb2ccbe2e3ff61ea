"""`python -m nemo_ckpt plot|runs`: curves of a run and the runs under a log directory."""

import argparse
import sys

from nemo_ckpt.logger.plot import DEFAULT_METRICS, plot_run
from nemo_ckpt.logger.runs import find_runs

COMMANDS = ("plot", "runs")


def _steps(first: int | None, last: int | None) -> str:
    return "no steps logged" if first is None else f"steps {first}-{last}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_ckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_plot = sub.add_parser("plot", help="plot the logged metrics of every version of a run, joined by step")
    p_plot.add_argument("run_dir", help="<log_dir>/<name> of NeMoLogger")
    p_plot.add_argument("--metrics", default=",".join(DEFAULT_METRICS), help="comma-separated logged names")
    p_plot.add_argument("--out", default=None, help="PNG to write (default: <run_dir>/curves.png)")
    p_runs = sub.add_parser("runs", help="list runs, their versions, last step and last checkpoint")
    p_runs.add_argument("log_dir", help="NeMoLogger's log_dir (or one <log_dir>/<name>)")
    args = parser.parse_args(argv)
    try:
        if args.command == "plot":
            metrics = [name.strip() for name in args.metrics.split(",") if name.strip()]
            out, data = plot_run(args.run_dir, metrics, args.out)
            for metric, values in data.items():
                print(f"{metric}: {len(values)} points, {_steps(min(values), max(values))}")
            print(f"wrote {out}")
        else:
            runs = find_runs(args.log_dir)
            if not runs:
                print(f"no runs under {args.log_dir}")
            for run in runs:
                last = "none" if run.last_step is None else run.last_step
                print(
                    f"{run.name} ({run.path}): {len(run.versions)} version(s), last logged step {last}, "
                    f"last checkpoint {run.last_checkpoint or 'none'}"
                )
                for version in run.versions:
                    print(f"  {version.name}: {_steps(version.first_step, version.last_step)}")
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
