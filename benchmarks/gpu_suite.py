"""The GPU suite: on one CUDA GPU, in one go and under ten minutes, a full DP-SGD step of fxdp and of every Opacus
mode as a ratio to a plain step, measured side by side in one run per model:

- MNIST CNN (batch 1024), ResNet-GroupNorm (256), the 2-layer transformer (128): the batches of
  ``benchmarks/dp_step_speed.py`` times 4, as in docs/performance.md's GPU table; the deep-narrow model (16 blocks
  of Linear(32, 32) + LayerNorm + GELU, batch 4), where each library's own code per layer sets the time;
- GPT-2 small (124M, T = 256) full fine-tuning and LoRA r = 8, at batch 8 and 32 (``benchmarks/lm_finetune_speed.py
  --size small``).

Rows: ``fxdp eager`` (the compiled graph, book-keeping sink, DP optimizer), every Opacus mode, and ``fxdp compiled``
(``make_private(..., compile=True)``) where this fxdp has that option ("not available" where it does not). The
compiled row comes from a run of its own (plain step included: its ratio is to that run's plain step), after all
the others, so that a slow compilation cannot take the other rows' time. Each run is a subprocess with a time
limit of its own and all share one budget (``--budget-s``): a model that runs out is reported as such, and the rest
go on. The device's name stands beside every figure; the markdown table, the raw rows (JSON) and each run's output
go under ``--out``.

``--smoke``: the whole pipeline on the CPU with tiny sizes, one thread, one timed step per engine and GPT-2 (one
layer, width 32) at batch 2 only, to check the script without a GPU; its figures mean nothing.

Usage: python benchmarks/gpu_suite.py --out DIR [--smoke] [--budget-s 560] [--repeats 10] [--compiled auto]
       [--only cnn,resnet,transformer,deep-narrow,gpt2]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = "rows of one model: "  # benchmarks/dp_step_speed.py's marker before a model's rows (--rows-only)
# (model, batch on the GPU, time limit in seconds of its main run)
SMALL = [("cnn", 1024, 90), ("resnet", 256, 90), ("transformer", 128, 90), ("deep-narrow", 4, 90)]
GPT2_BATCHES = [(8, 150), (32, 180)]
COMPILED_LIMIT = 120  # seconds of a compiled run (one per model, after every main run)
OPACUS = ["opacus-hooks", "opacus-ghost", "opacus-functorch", "opacus-ew"]
COLUMNS = ["fxdp", "fxdp-compiled"] + OPACUS  # the table's columns, as the benchmarks name the engines
HEADERS = ["fxdp eager", "fxdp compiled", "Opacus hooks", "ghost", "functorch", "ew"]


class Suite:
    """The runs, each under its own limit and the suite's budget, and what they gave: {row key: {engine: cell}}."""

    def __init__(self, args):
        self.args, self.deadline = args, time.monotonic() + args.budget_s
        self.device = "cpu" if args.smoke else "cuda"
        self.device_name = "CPU (smoke run: figures mean nothing)" if args.smoke else torch.cuda.get_device_name()
        self.cells: Dict[tuple, Dict[str, dict]] = {}
        self.logs = os.path.join(args.out, "logs")
        os.makedirs(self.logs, exist_ok=True)

    def run(self, label: str, cmd: List[str], limit: float) -> Optional[str]:
        """Run ``cmd`` (its output logged under ``logs/label.log``); its stdout, or None with the reason kept in
        ``self.why``."""
        self.why = "no rows in its output"
        left = self.deadline - time.monotonic() - 5
        if left < 20:
            self.why = "skipped: the suite's time budget ran out"
            return None
        limit = min(limit * (3 if self.args.smoke else 1), left)  # (a CPU, perhaps a busy one, is slower)
        started = time.monotonic()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(HERE),
                                                                          os.environ.get("PYTHONPATH")])))
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
            out, err, code = done.stdout, done.stderr, done.returncode
        except subprocess.TimeoutExpired as exc:
            out, err, code = _text(exc.stdout), _text(exc.stderr), None
        with open(os.path.join(self.logs, f"{label}.log"), "w", encoding="utf-8") as f:
            f.write(f"$ {' '.join(cmd)}\n# exit {code}, {time.monotonic() - started:.0f} s\n{out}\n--- stderr\n{err}")
        print(f"[{label}] {'timed out' if code is None else f'exit {code}'} after {time.monotonic() - started:.0f} s "
              f"(limit {limit:.0f} s)", flush=True)
        if code is None:
            self.why = f"timed out after {limit:.0f} s"
            return None
        if code != 0:
            self.why = f"failed (exit {code}): {(err.strip().splitlines() or ['?'])[-1][:80]}"
            return None
        return out

    def small_model(self, name: str, batch: int, limit: float, engines: str = "") -> None:
        repeats = self.args.repeats
        cmd = [sys.executable, os.path.join(HERE, "dp_step_speed.py"), "--models", name, "--rows-only", "--device",
               self.device, "--repeats", str(repeats), "--batch", str(batch), "--engines", engines]
        cmd += ["--threads", "1"] if self.args.smoke else []
        label = f"{name}-{'compiled' if engines else 'main'}"
        out = self.run(label, cmd, limit)
        key = (name, batch)
        if out is None or not out.splitlines() or not out.splitlines()[-1].startswith(ROWS):
            self.fail(key, ["fxdp-compiled"] if engines else ["plain"] + [c for c in COLUMNS if c != "fxdp-compiled"],
                      self.why)
            return
        for _, _, engine, ms, ratio, mem, mem_ratio, _, error in json.loads(out.splitlines()[-1][len(ROWS):]):
            if engines and engine != engines:
                continue  # (a compiled run's own plain step: its ratio is already in the compiled row)
            if ratio == "":
                self.put(key, engine, error=f"{ms}: {error}" if ms != "not available" else "not available")
            else:
                self.put(key, engine, ms=float(ms), ratio=float(ratio), mem_ratio=float(mem_ratio))

    def gpt2(self, batch: int, limit: float, engines: str = "") -> None:
        keys = {lora: self.gpt2_key(lora, batch) for lora in (False, True)}
        if importlib.util.find_spec("transformers") is None:
            for key in keys.values():
                self.fail(key, ["plain"] + COLUMNS, "skipped: transformers not installed")
            return
        json_path = os.path.join(self.args.out, f"gpt2-b{batch}-{'compiled' if engines else 'main'}.json")
        cmd = [sys.executable, os.path.join(HERE, "lm_finetune_speed.py"), "--device", self.device, "--batch",
               str(batch), "--rounds", "1", "--repeats", str(self.args.repeats), "--json", json_path]
        cmd += (["--layers", "1", "--width", "32", "--heads", "2", "--seq", "16", "--vocab", "512"] if self.args.smoke
                else ["--size", "small"])
        cmd += ["--engines", engines] if engines else []
        cmd += ["--threads", "1"] if self.args.smoke else []
        if importlib.util.find_spec("peft") is None:
            cmd.append("--no-lora")
            self.fail(keys[True], ["plain"] + COLUMNS, "skipped: peft not installed")
        if self.run(f"gpt2-b{batch}-{'compiled' if engines else 'main'}", cmd, limit) is None:
            for lora, key in keys.items():
                if not (lora and importlib.util.find_spec("peft") is None):
                    self.fail(key, [engines] if engines else ["plain"] + [c for c in COLUMNS if c != "fxdp-compiled"],
                              self.why)
            return
        with open(json_path, encoding="utf-8") as f:
            for row in json.load(f)["rows"]:
                if engines and row["engine"] != engines:
                    continue
                key = keys[row["lora"]]
                if row["ms"] is None:
                    error = row["error"]
                    error = "not available" if error.startswith("not available") else f"fails: {error}"
                    self.put(key, row["engine"], error=error)
                else:
                    self.put(key, row["engine"], ms=row["ms"], ratio=row["ratios"][-1],
                             mem_ratio=row["memory_ratio"])

    def gpt2_key(self, lora: bool, batch: int) -> tuple:
        return (f"GPT-2 {'tiny' if self.args.smoke else 'small'}, {'LoRA r=8' if lora else 'full fine-tuning'}", batch)

    def put(self, key: tuple, engine: str, **cell) -> None:
        self.cells.setdefault(key, {})[engine] = cell

    def fail(self, key: tuple, engines: List[str], why: str) -> None:
        for engine in engines:
            self.put(key, engine, error=why)


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def compile_option_available() -> bool:
    """Whether ``fxdp.PrivacyEngine().make_private`` takes ``compile=True`` (it refuses an unknown keyword with a
    TypeError): tried on a tiny model on the CPU."""
    import fxdp
    from torch import nn

    model = nn.Linear(3, 2)
    data = torch.utils.data.TensorDataset(torch.randn(4, 3), torch.randint(0, 2, (4,)))
    try:
        fxdp.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
            data_loader=torch.utils.data.DataLoader(data, batch_size=4), max_grad_norm=1.0, poisson_sampling=False,
            compile=True)
    except TypeError as exc:
        return "compile" not in str(exc)
    except Exception:  # noqa: BLE001 - the option exists and fails here: the compiled runs report how
        return True
    return True


def cell_text(cell: Optional[dict]) -> str:
    if cell is None:
        return "-"
    if "error" in cell:  # (the whole message is in the run's log)
        error = cell["error"].replace("|", "/")
        return error if len(error) <= 70 else error[:67] + "..."
    return f"{cell['ratio']:.2f}x"


def tables(suite: Suite) -> str:
    """The markdown: one row per model and batch, each engine's step as a ratio to the plain step of its run."""
    lines = [f"| model | batch | device | plain ms | noise only | {' | '.join(HEADERS)} | fxdp peak mem / plain |",
             "|" + "---|" * (len(HEADERS) + 6)]
    for (model, batch), cells in suite.cells.items():
        plain, fxdp = cells.get("plain", {}), cells.get("fxdp", {})
        plain_ms = f"{plain['ms']:.1f}" if "ms" in plain else cell_text(plain or None)
        ratios = [cell_text(cells.get(engine)) for engine in ["noise only"] + COLUMNS]
        memory = f"{fxdp['mem_ratio']:.2f}" if "mem_ratio" in fxdp else "-"
        lines.append(f"| {model} | {batch} | {suite.device_name} | {plain_ms} | {' | '.join(ratios)} | {memory} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the markdown table, the JSON rows and the logs")
    parser.add_argument("--smoke", action="store_true", help="the whole pipeline on the CPU, tiny sizes")
    parser.add_argument("--budget-s", type=float, default=560, help="seconds for all the runs together")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per engine (10; 1 with --smoke)")
    parser.add_argument("--compiled", choices=["auto", "always", "never"], default="auto",
                        help="the compiled runs: where make_private takes compile=True (auto), always, never")
    parser.add_argument("--only", default=None,
                        help="comma-separated subset of cnn, resnet, transformer, deep-narrow, gpt2 (default: all)")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    args.repeats = args.repeats or (1 if args.smoke else 10)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA GPU here (torch.cuda.is_available() is False); --smoke runs the pipeline on the CPU")
    os.makedirs(args.out, exist_ok=True)
    suite = Suite(args)
    compiled = args.compiled == "always" or (args.compiled == "auto" and compile_option_available())
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"GPU suite on {suite.device_name}, torch {torch.__version__}, budget {args.budget_s:.0f} s, "
          f"make_private(compile=True) {'runs' if compiled else 'not available'}", flush=True)
    small = [(name, 4 if args.smoke else batch, limit) for name, batch, limit in SMALL if not only or name in only]
    gpt2 = [(2, limit) for _, limit in GPT2_BATCHES[:1]] if args.smoke else GPT2_BATCHES  # smoke: one batch of 2
    gpt2 = [(batch, limit) for batch, limit in gpt2 if not only or "gpt2" in only]
    for name, batch, limit in small:
        suite.small_model(name, batch, limit)
    for batch, limit in gpt2:
        suite.gpt2(batch, limit)
    for name, batch, _ in small:
        if compiled:
            suite.small_model(name, batch, COMPILED_LIMIT, engines="fxdp-compiled")
        else:
            suite.put((name, batch), "fxdp-compiled", error="not available")
    for batch, _ in gpt2:
        if compiled:
            suite.gpt2(batch, COMPILED_LIMIT, engines="fxdp-compiled")
        else:
            for lora in (False, True):
                key = suite.gpt2_key(lora, batch)
                if "fxdp-compiled" not in suite.cells.get(key, {}):
                    suite.put(key, "fxdp-compiled", error="not available")
    elapsed = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()
    gpt2_size = "1 layer, width 32, T=16 (smoke)" if args.smoke else "12 layers, width 768, T=256"
    header = (f"# GPU suite: {suite.device_name}\n\n`python benchmarks/gpu_suite.py "
              f"{' '.join(sys.argv[1:])}`, {started:%Y-%m-%d %H:%M} UTC, {elapsed:.0f} s; "
              f"torch {torch.__version__}, device **{suite.device_name}** for every figure below. Each cell: the "
              f"engine's step (forward, backward, clip, noise, optimizer step) as a ratio to the plain step measured "
              f"in the same run, engines taking turns, median of {args.repeats} steps; `fxdp compiled` from a run of "
              f"its own, against that run's plain step. GPT-2: {gpt2_size}. Logs of each run: `logs/`.\n\n")
    text = header + tables(suite) + "\n"
    with open(os.path.join(args.out, "gpu_suite.md"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(args.out, "gpu_suite.json"), "w", encoding="utf-8") as f:
        json.dump({"device": suite.device_name, "torch": torch.__version__, "elapsed_s": elapsed,
                   "rows": [dict(model=m, batch=b, cells=c) for (m, b), c in suite.cells.items()]}, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
