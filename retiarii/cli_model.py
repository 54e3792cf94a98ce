"""``retiarii status DB --model ID``: one model in full: its whole sample, status, value, why it
failed, and each of its trials with its learning curve (the table of ``status`` cuts samples)."""
from __future__ import annotations

import json

from .cli_common import CliError, format_table, store_metric

__all__ = ["model_detail", "print_model"]


def model_detail(store, model_id: int) -> dict:
    """What ``status --model`` shows, as JSON: the model row (sample, hash, status, value,
    error) and its trials (state, steps, error, the metric's curve)."""
    from .engine.storage.store import StoreError

    try:
        model = store.get_model(model_id)
    except StoreError as err:
        raise CliError(f"--model {model_id}: {err}; `retiarii status` lists the models") from None
    if model["experiment_id"] != store.experiment_id:
        raise CliError(f"--model {model_id}: a model of experiment {model['experiment_id']}, "
                       f"not {store.experiment_id}: add --experiment {model['experiment_id']}")
    metric, mode = store_metric(store)
    trials = [t for t in store.trials() if t.get("model_id") == model_id]
    return {"model_id": model_id, "hash": model["hash"], "status": model["status"],
            "value": model.get("value"), "metric": metric, "mode": mode,
            "sample": model["sample"], "error": model.get("error"),
            "trials": [{"trial_id": t["id"], "state": t["state"], "step": t.get("step"),
                        "error": t.get("error"),
                        "curve": store.learning_curve(t["id"], metric)} for t in trials]}


def print_model(detail: dict) -> None:
    """The text form of :func:`model_detail`: every choice on a line of its own."""
    print(f"model {detail['model_id']} ({detail['status']}), {detail['metric']} "
          f"({detail['mode']}): {detail['value']}   hash {detail['hash']}")
    print(format_table([[k, json.dumps(v)] for k, v in detail["sample"].items()],
                       ["choice", "chosen"]))
    if detail["error"]:
        print(f"\nwhy it failed:\n{detail['error']}")
    for t in detail["trials"]:
        curve = ", ".join(f"{s}: {v:.4g}" if isinstance(v, (int, float)) else f"{s}: -"
                          for s, v in t["curve"])
        print(f"\ntrial {t['trial_id']} {t['state']} at step {t['step']}: {curve or '-'}")
        if t["error"] and not detail["error"]:
            print(t["error"])
