"""The `lockstep` command line.

    lockstep train CONFIG [-o key=value ...]

A bad config exits with code 2 and a message naming the file, the field and the reason, before any work.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _quiet_environment() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


class _Progress:
    """Live display: bootstrap progress, then reward, accuracy, tokens/s and time left per iteration.

    On a terminal it is a rich progress bar; elsewhere (CI logs, pipes) one plain line every few iterations.
    """

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = console
        self.live = console.is_terminal
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                                 TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                                 console=console, transient=False, disable=not self.live)
        self.boot = self.iters = None
        self.accuracy = float("nan")
        self.total = 0
        self.t_start = time.perf_counter()
        self.done_iters = 0

    def _line(self, text: str) -> None:
        if not self.live:
            self.console.print(text, highlight=False)

    def __call__(self, e: dict) -> None:
        kind = e["event"]
        if kind == "setup":
            self.progress.start()
        elif kind == "bootstrap":
            if self.boot is None:
                self.boot = self.progress.add_task("bootstrap", total=e["steps"], info="")
            self.progress.update(self.boot, completed=e["step"], info=f"loss {e['loss']:.3f}")
            if e["step"] % max(1, e["steps"] // 5) == 0:
                self._line(f"bootstrap SFT step {e['step']}/{e['steps']} loss {e['loss']:.3f}")
        elif kind == "start":
            self.accuracy, self.total = e["accuracy"], e["iterations"]
            self.t_start = time.perf_counter()
            self.first = e["start"]
            self.iters = self.progress.add_task("RL", total=e["iterations"], completed=e["start"], info="")
            self.console.print(f"run {e['run_id']}: initial held-out accuracy {e['accuracy']:.3f}", highlight=False)
        elif kind == "iteration":
            self.accuracy = e.get("eval/accuracy", self.accuracy)
            k = e["iteration"] + 1
            info = (f"reward {e['reward/mean']:.3f} acc {self.accuracy:.3f} gen {e['perf/gen_tokens_per_s']:.0f} tok/s "
                    f"train {e['perf/train_tokens_per_s']:.0f} tok/s")
            self.progress.update(self.iters, completed=k, info=info)
            if k % max(1, self.total // 20) == 0 or "eval/accuracy" in e or k == self.total:
                per_iter = (time.perf_counter() - self.t_start) / max(1, k - self.first)
                self._line(f"iteration {k}/{self.total} {info} {e['time/iteration_s']:.2f} s/it "
                           f"eta {per_iter * (self.total - k):.0f} s")
        elif kind == "done":
            self.progress.stop()

    def stop(self):
        self.progress.stop()


def cmd_train(args) -> int:
    from rich.console import Console

    from configs.schema import ConfigError, load_config

    console = Console(stderr=True)
    try:
        load_config(args.config, args.override)  # fail fast, before Prefect or any work starts
    except ConfigError as e:
        console.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
        return 2
    import flows.train as train_mod

    progress = _Progress(console)
    train_mod.progress_hook = progress
    t0 = time.perf_counter()
    try:
        summary = train_mod.train_flow(config_path=args.config, overrides=args.override)
    finally:
        progress.stop()
    console.print(
        f"done in {time.perf_counter() - t0:.0f} s: held-out accuracy {summary['eval_accuracy_initial']:.3f} -> "
        f"{summary['eval_accuracy_final']:.3f}, {summary['samples_per_s']:.1f} samples/s, "
        f"version {summary['promoted_version']}"
    )
    print(f"{summary['run_id']} {summary['summary_path']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lockstep", description="On-policy periodic-asynchronous RL for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run an experiment from a YAML config")
    p.add_argument("config", help="YAML config, e.g. configs/arith-tiny.yaml")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. -o trainer.lr=1e-5 (repeatable)")
    p.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    _quiet_environment()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
