"""The measured cases of scripts/bench-gpu's JSON (a list of `epmoe bench --json`
documents), for the scripts that read it (compare-variants.py, issue-targets.py)."""


def cases(runs):
    """Yields (model, quant, ep, tokens) and the result of each case. A document from before
    the fp8 schemes names no quant: bf16."""
    for run in runs:
        for result in run["results"]:
            yield (run["model"], run.get("quant", "bf16"), run["ep"], result["tokens"]), result
