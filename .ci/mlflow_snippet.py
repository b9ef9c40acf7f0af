"""Run the MLflow snippet of a guide page as written, in the current directory.

The snippet is the ```python block that calls ``mlflow.start_run()``. Its names come from the
page's own loop (``privmon``, ``query``, ``members``, ``heldout``): a small classifier defines
them here. Its ``...`` (the user's training loop) becomes one check, ``monitor.check(1)``.
Then the figures are read back from MLflow's default store and from the JSON lines."""

import json
import re
import sys
from pathlib import Path

page = Path(sys.argv[1]).read_text()
blocks = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "mlflow.start_run()" in b]
if len(blocks) != 1:
    sys.exit(f"mlflow_snippet: expected one MLflow snippet in {sys.argv[1]}, found {len(blocks)}")
lines = blocks[0].splitlines()
loop = [i for i, line in enumerate(lines) if line.strip() == "..."]
if len(loop) != 1:
    sys.exit("mlflow_snippet: the snippet's training loop is no longer one `...` line")
lines[loop[0]] = lines[loop[0]].replace("...", "monitor.check(1)")
snippet = "\n".join(lines)

prelude = """
import torch
import privmon
from privmon.queries import LossQuery
torch.manual_seed(0)
x, y = torch.randn(400, 8), torch.randint(0, 2, (400,))
query = LossQuery(torch.nn.Linear(8, 2))
members = [(x[i : i + 100], y[i : i + 100]) for i in range(0, 200, 100)]
heldout = [(x[i : i + 100], y[i : i + 100]) for i in range(200, 400, 100)]
"""
exec(compile(prelude + snippet, "mlflow-snippet", "exec"), {"__name__": "__main__"})

import mlflow  # noqa: E402

print(f"mlflow_snippet: mlflow {mlflow.__version__}, store {mlflow.get_tracking_uri()}")
client = mlflow.MlflowClient()
runs = client.search_runs(experiment_ids=["0"])
if len(runs) != 1:
    sys.exit(f"mlflow_snippet: expected one MLflow run, found {len(runs)}")
logged = client.get_metric_history(runs[0].info.run_id, "privacy/loss/histogram/value")
line = json.loads(Path("runs/exp1/checks.jsonl").read_text().splitlines()[-1])
if [m.step for m in logged] != [1]:
    sys.exit(f"mlflow_snippet: expected the check at step 1 in MLflow, got {logged}")
print(
    f"mlflow_snippet: ok, {len(runs[0].data.metrics)} metrics in run {runs[0].info.run_id}, "
    f"loss/histogram/value {logged[0].value:.3f}; checks.jsonl step {line['step']}"
)
