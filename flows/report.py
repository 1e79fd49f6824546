"""`lockstep report RUN_ID`: a PNG and an HTML page of a run's figures per iteration, also logged to MLflow.

Panels: reward and held-out accuracy; throughput (samples/s, generation and training tokens/s); phase times
(iteration, rollout busy, train busy, train waiting, first shard, reward scoring); overhead and overlap fractions.
"""

from __future__ import annotations

import base64
import html
import io
import os

PANELS = {
    "reward and accuracy": ["reward/mean", "eval/accuracy"],
    "throughput": ["perf/samples_per_s", "perf/gen_tokens_per_s", "perf/train_tokens_per_s"],
    "phase times (s)": [
        "time/iteration_s",
        "time/rollout_busy_s",
        "time/train_busy_s",
        "time/train_wait_s",
        "time/first_shard_s",
        "time/reward_s",
    ],
    "fractions": ["perf/overhead_fraction", "perf/overlap_fraction"],
}


def run_metrics(tracking_uri: str, run_id: str) -> tuple[str, dict[str, list[tuple[int, float]]]]:
    from mlflow.tracking import MlflowClient

    if tracking_uri.startswith("sqlite:///"):  # MLflow would create an empty database there
        db = os.path.abspath(tracking_uri.removeprefix("sqlite:///"))
        if not os.path.isfile(db):
            raise FileNotFoundError(
                f"no MLflow database at {db} (tracking.uri {tracking_uri!r}; a relative path is "
                "read from the directory the command runs in: run it where the run was trained)"
            )
    client = MlflowClient(tracking_uri=tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string=f"tags.`lockstep.run_id` = '{run_id}'", max_results=1)
    if not runs:
        raise FileNotFoundError(f"no MLflow run tagged lockstep.run_id={run_id} at {tracking_uri}")
    mlflow_id = runs[0].info.run_id
    out = {}
    for key in {k for keys in PANELS.values() for k in keys}:
        hist = sorted((m.step, m.value) for m in client.get_metric_history(mlflow_id, key))
        if hist:
            out[key] = hist
    return mlflow_id, out


def render(run_id: str, metrics: dict[str, list[tuple[int, float]]], out_dir: str) -> tuple[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    for ax, (title, keys) in zip(axes.flat, PANELS.items()):
        for key in keys:
            if key in metrics:
                steps, values = zip(*metrics[key])
                ax.plot(steps, values, "o-" if key == "eval/accuracy" else "-", label=key, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if ax.lines:  # a panel whose figures the run did not log stays empty, without a legend
            ax.legend(fontsize=7)
    fig.suptitle(f"lockstep run {run_id}")
    fig.tight_layout()
    png = os.path.join(out_dir, f"{run_id}-report.png")
    buf = io.BytesIO()
    fig.savefig(buf, dpi=100, format="png")
    plt.close(fig)
    with open(png, "wb") as f:
        f.write(buf.getvalue())
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{len(v)}</td><td>{v[0][1]:.4g}</td><td>{v[-1][1]:.4g}</td></tr>"
        for k, v in sorted(metrics.items())
    )
    page = (
        f"<!doctype html><meta charset='utf-8'><title>lockstep {html.escape(run_id)}</title>"
        f"<h1>lockstep run {html.escape(run_id)}</h1>"
        f"<img alt='figures per iteration' src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}'>"
        f"<table border=1 cellpadding=4><tr><th>metric</th><th>points</th><th>first</th><th>last</th></tr>{rows}"
        f"</table>"
    )
    page_path = os.path.join(out_dir, f"{run_id}-report.html")
    with open(page_path, "w") as f:
        f.write(page)
    return png, page_path
