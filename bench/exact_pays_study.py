"""When exact mode pays: GRPO on the reread task (a field the warm-up never asked for), detached against exact.

    python bench/exact_pays_study.py                   # sweep + 3 seeds x {detached, exact}; JSON + PNG under bench/
    python bench/exact_pays_study.py --lrs 1e-3 --sweep-steps 0 --steps 20 --seeds 0   # one lr, no sweep, shorter
    python bench/exact_pays_study.py --task reread_hint --lrs 5e-4,1e-3 --steps 40   # the variant with a hint warm-up
    python bench/exact_pays_study.py --task reread_hint_gdn --lrs 1e-3,2e-3 --sweep-steps 10 --steps 40  # GDN-heavy

--task picks the task (TASKS): reread (tasks/reread.py, configs/run/reread_task.yaml) or reread_hint
(tasks/reread_hint.py, configs/run/reread_hint_task.yaml: a warm-up that reads second fields at one record, GRPO on a
mark it never saw at two records) or reread_hint_gdn (the same task and recipe on the GDN-heavy model
configs/models/recall_qwen3_5_gdn.yaml: three Gated DeltaNet layers, then one attention layer; configs/run/
reread_hint_gdn.yaml); each has its own warm-up directory, work directory, JSON and plot.

1. The warm-up (reread: reread.WARMUP, "? k" -> the key's first field v at short prompts; reread_hint: its two-phase
   warm_checkpoint; built once into runs/<task>/warmup, then reused). GRPO then asks "! k" -> the second field w.
2. The learning-rate sweep: every lr of --lrs, for each mode, one run of --sweep-steps steps at seed SWEEP_SEED (its
   own training prompts and samples; the held-out prompts are the study's); each mode keeps the lr whose run ends
   with the best held-out accuracy at the trained length (the mean of its last two evaluations, so that one noisy
   evaluation does not decide). The same lrs, steps and rule for both modes.
3. The study: --seeds x {detached, exact} at each mode's lr, --steps steps each, the held-out accuracy (stream
   recall_warmup.EVAL_SEED, never trained on) at the trained length and at --long-length every --eval-every steps.

Every run is ds_longstraw.tasks.recall_grpo with the task's run config (one rank, gloo, ZeRO-3 on CPU) in its
own process; the detached and the exact run of one seed (or of one sweep lr) run side by side, one thread each, so
that their seconds are measured under the same load. Equal seconds: each run's clock is the sum of its steps'
seconds (rollout + transaction + optimizer; evaluations excluded); a mode's accuracy at S seconds is read off its
evaluations by linear interpolation in that clock. A seed's fixed-seconds budget is the shorter total of its two
runs (the pair ran under the same load; the machine's load may differ between pairs). Writes the task's JSON and
plot (reread: bench/results/exact_pays_study.json, bench/exact_pays_study.png; reread_hint: exact_pays_hint.*):
accuracy against step and against seconds, both lengths. --reuse keeps the runs that finished (a study cut short, or
a new summary of the same runs).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from recall_study import run_pair  # noqa: E402 -- two runs side by side, the recall study's helper

# task -> (run config, work directory under runs/, JSON and plot names)
TASKS = {"reread": ("reread_task.yaml", "reread", "exact_pays_study"),
         "reread_hint": ("reread_hint_task.yaml", "reread_hint", "exact_pays_hint"),
         "reread_hint_gdn": ("reread_hint_gdn.yaml", "reread_hint_gdn", "exact_pays_hint_gdn")}
SWEEP_SEED = 100
MODES = ("detached", "exact")


def grpo_job(work, name, warm, prefix_grad, seed, steps, lr, args):
    """(argv, log path) of one recall_grpo run on the task's run config."""
    lengths = f"{args.length},{args.long_length}"
    run_config = ROOT / "configs" / "run" / TASKS[args.task][0]
    argv = [sys.executable, "-m", "ds_longstraw.tasks.recall_grpo", "--run-config", str(run_config),
            "--warm", str(warm), "--prefix-grad", prefix_grad, "--seed", str(seed), "--steps", str(steps),
            "--eval-every", str(args.eval_every), "--eval-lengths", lengths, "--eval-prompts", str(args.eval_prompts),
            "--threads", "1", "--out", str(work / name), f"optim.lr={lr}",
            f"rollout.prompt_args.prompt_tokens={args.length}", *args.overrides]
    return argv, work / f"{name}.log"


def done(work, name, args):
    """With --reuse, a run whose result.json exists is not run again (its result is read back)."""
    return args.reuse and (work / name / "result.json").exists()


def load(work, name):
    result = json.loads((work / name / "result.json").read_text())
    clock, total = {0: 0.0}, 0.0
    for step in result["steps"]:
        total += step["seconds"]
        clock[step["step"]] = total
    result["clock"] = [round(clock[e["step"]], 2) for e in result["evals"]]  # seconds of training at each evaluation
    result["total_seconds"] = round(total, 2)
    return result


def final_accuracy(run, length, last=2):
    """The mean of the run's last `last` held-out evaluations at `length` (the sweep's criterion)."""
    return statistics.fmean(e["accuracy"][str(length)] for e in run["evals"][-last:])


def at_seconds(run, length, seconds):
    """Held-out accuracy at `length` after `seconds` of training, linear between evaluations (None past the run)."""
    points = list(zip(run["clock"], (e["accuracy"][str(length)] for e in run["evals"]), strict=True))
    for (t0, a0), (t1, a1) in zip(points, points[1:], strict=False):
        if t0 <= seconds <= t1:
            return a0 + (a1 - a0) * (seconds - t0) / max(t1 - t0, 1e-9)
    return None


def spread(values):
    """(mean, min, max) of the seeds' values, rounded."""
    return {"mean": round(statistics.fmean(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def summarise(runs, lengths, steps_budget, seconds_budget):
    """Per mode: lr, seconds per step, and mean [min, max] over the seeds of the held-out accuracy at each length
    after `steps_budget` steps and after `seconds_budget[seed]` seconds of training."""
    out = {}
    for mode in MODES:
        mine = [r for r in runs if r["prefix_grad"] == mode]
        out[mode] = {
            "lr": mine[0]["lr"],
            "seconds_per_step": spread([r["total_seconds"] / len(r["steps"]) for r in mine]),
            "at_steps": {str(n): spread([r["evals"][-1]["accuracy"][str(n)] for r in mine]) for n in lengths},
            "at_seconds": {str(n): spread([at_seconds(r, n, seconds_budget[r["seed"]]) for r in mine])
                           for n in lengths},
        }
    out["steps_budget"] = steps_budget
    out["seconds_budget"] = {str(seed): round(t, 1) for seed, t in seconds_budget.items()}
    return out


def gradient_reach(warm, *, prompts=8, samples=8, temperature=2.0, seed=0, length=40):
    """Where one GRPO step's gradient lands, exact against detached, in plain torch on the warm-up checkpoint `warm`
    (transformers forwards, no engine): `prompts` "! k" prompts at `length` tokens (the training stream, seed `seed`),
    `samples` one-token answers each drawn at `temperature`, rewarded by reread_hint.reward; the loss is the GRPO
    surrogate of a step's first update (ratio 1, so no clipping): -mean(advantage * log p(answer)), the advantage a
    reward minus its group's mean over the group's std (+1e-6). Two gradients of that one loss:
      exact     full-sequence autograd (what exact mode equals)
      detached  the prompt's first length-1 tokens run under no_grad into the model's cache (K/V, the GDN layers'
                convolution tails and recurrent states: constants), then the last token with grad: the transformers
                cache continuation that detached mode equals (tests/equivalence/test_transaction.py)
    Returns per mode the gradient's norm per parameter group (the embedding rows of "!", of the keys and of the
    values; each layer and its mixer; lm_head; all), the same norms of exact minus detached (the part that reaches
    the parameters through the prompt's positions) and the cosine between the two whole gradients."""
    import torch
    from transformers import AutoModelForCausalLM

    from ds_longstraw.tasks import reread_hint

    model = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)
    model.eval()  # no dropout: the two modes differ only in the gradient's path
    sizes = {"prompt_tokens": length, "records": 2, "keys": 4, "values": 6, "fillers": 3, "ask": "second"}
    batch, _ = reread_hint.batch(seed, 0, prompts, **sizes)
    ids = batch.repeat_interleave(samples, dim=0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=batch).logits[:, -1] / temperature, dim=-1)
        answers = torch.multinomial(probs, samples, replacement=True, generator=gen).reshape(-1)
    rewards = torch.tensor([reread_hint.reward(p, [int(a)]) for p, a in zip(ids, answers, strict=True)])
    grouped = rewards.reshape(prompts, samples)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).reshape(-1)

    def gradient(mode):
        model.zero_grad()
        if mode == "exact":
            logits = model(input_ids=ids).logits[:, -1]
        else:
            with torch.no_grad():
                cache = model(input_ids=ids[:, :-1], use_cache=True).past_key_values
            for layer in cache.layers:  # transformers copies the new recurrent state into the tensor autograd saved:
                if hasattr(layer, "recurrent_states"):  # assign instead (tests/models.py does the same)
                    def update(states, state_idx=0, _layer=layer, **kwargs):
                        _layer.recurrent_states[state_idx] = states
                        return states

                    layer.update_recurrent_state = update
            logits = model(input_ids=ids[:, -1:], past_key_values=cache).logits[:, -1]
        logp = torch.log_softmax(logits, dim=-1).gather(1, answers[:, None])[:, 0]
        (-(advantages * logp).mean()).backward()
        return {name: p.grad.detach().clone() for name, p in model.named_parameters()}

    grads = {mode: gradient(mode) for mode in MODES}
    first_value = reread_hint.FIRST_KEY + sizes["keys"]
    rows = {"embedding '!'": [reread_hint.ASK_SECOND],
            "embedding, keys": list(range(reread_hint.FIRST_KEY, first_value)),
            "embedding, values": list(range(first_value, first_value + sizes["values"]))}

    def norms(g):
        out = {group: float(g["model.embed_tokens.weight"][ids_].norm()) for group, ids_ in rows.items()}
        for i, kind in enumerate(model.config.layer_types):
            layer = [t for name, t in g.items() if name.startswith(f"model.layers.{i}.")]
            out[f"layer {i} ({kind})"] = float(torch.cat([t.reshape(-1) for t in layer]).norm())
            mixer = "linear_attn" if kind == "linear_attention" else "self_attn"
            mine = [t for name, t in g.items() if name.startswith(f"model.layers.{i}.{mixer}.")]
            out[f"layer {i} {mixer}"] = float(torch.cat([t.reshape(-1) for t in mine]).norm())
        out["lm_head"] = float(g["lm_head.weight"].norm())
        out["all"] = float(torch.cat([t.reshape(-1) for t in g.values()]).norm())
        return {k: round(v, 6) for k, v in out.items()}

    flat = {mode: torch.cat([t.reshape(-1) for t in grads[mode].values()]) for mode in MODES}
    cosine = float(torch.nn.functional.cosine_similarity(flat["exact"], flat["detached"], dim=0))
    return {"warm": str(warm), "layer_types": list(model.config.layer_types), "prompts": prompts, "samples": samples,
            "length": length, "temperature": temperature, "seed": seed, "mean_reward": round(float(rewards.mean()), 4),
            "norms": {mode: norms(grads[mode]) for mode in MODES},
            "through_prompt": norms({k: grads["exact"][k] - grads["detached"][k] for k in grads["exact"]}),
            "cosine": round(cosine, 6)}


def plot(study, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"detached": "tab:blue", "exact": "tab:red"}
    styles = ["--", ":", "-."]
    lengths = [study["length"], study["long_length"]]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.2), sharey=True)
    for row, length in enumerate(lengths):
        for col, axis_of in enumerate(("step", "seconds")):
            ax = axes[row][col]
            for run in study["runs"]:
                xs = [e["step"] for e in run["evals"]] if axis_of == "step" else run["clock"]
                ax.plot(xs, [e["accuracy"][str(length)] for e in run["evals"]], styles[run["seed"] % len(styles)],
                        color=colors[run["prefix_grad"]], marker=".", ms=3, lw=0.8, alpha=0.6,
                        label=f"{run['prefix_grad']} (lr {run['lr']:g}), seed {run['seed']}")
            for mode in MODES:  # the seeds' mean: by step directly, by seconds on the detached runs' clock grid
                mine = [r for r in study["runs"] if r["prefix_grad"] == mode]
                if axis_of == "step":
                    xs = [e["step"] for e in mine[0]["evals"]]
                    ys = [statistics.fmean(r["evals"][i]["accuracy"][str(length)] for r in mine)
                          for i in range(len(xs))]
                else:
                    end = min(r["total_seconds"] for r in mine)
                    xs = [min(end, end * i / 40) for i in range(41)]
                    ys = [statistics.fmean(at_seconds(r, length, x) for r in mine) for x in xs]
                ax.plot(xs, ys, "-", color=colors[mode], lw=2.4, label=f"{mode}, mean of seeds")
            levels = study["levels"]
            ax.axhline(levels["chance"], color="gray", lw=0.8, ls=":")
            ax.axhline(levels["random_record"], color="gray", lw=0.8, ls="--")
            if axis_of == "step":
                ax.axvline(study["steps"], color="black", lw=0.8, ls="--")
            ax.set_ylim(0, 1.02)
            ax.set_xlabel("GRPO step" if axis_of == "step" else "seconds of training (steps only, side by side)")
            ax.set_ylabel(f"held-out exact match, '! k' at {length} tokens")
            ax.set_title(f"{'trained' if length == study['length'] else 'longer'} length {length}, by {axis_of}",
                         fontsize=10)
    axes[0][0].text(0, study["levels"]["chance"] + 0.01, f"chance 1/values = {study['levels']['chance']:.3f}",
                    fontsize=8, color="gray")
    axes[0][0].text(0, study["levels"]["random_record"] + 0.01,
                    f"random record 1/records = {study['levels']['random_record']:.2f}", fontsize=8, color="gray")
    axes[0][0].legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(f"{study.get('task', 'reread')}: GRPO asks '! k' for the second field, detached against exact")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(study):
    """BENCHMARKS.md's table: per mode, mean [min, max] over the seeds at the fixed steps and at the fixed seconds."""
    summary, lengths = study["summary"], (study["length"], study["long_length"])
    rows = ["| mode | lr | s / step | " + " | ".join(f"@{n}, {study['steps']} steps" for n in lengths) + " | "
            + " | ".join(f"@{n}, equal seconds" for n in lengths) + " |",
            "|---|---:|---:|" + "---:|" * (2 * len(lengths))]
    for mode in MODES:
        s = summary[mode]
        cells = [f"{c['mean']:.3f} [{c['min']:.3f}, {c['max']:.3f}]"
                 for c in [s["at_steps"][str(n)] for n in lengths] + [s["at_seconds"][str(n)] for n in lengths]]
        rows.append(f"| {mode} | {s['lr']:g} | {s['seconds_per_step']['mean']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="reread")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lrs", default="2e-3,6e-3", help="the sweep's learning rates (one: no sweep)")
    parser.add_argument("--sweep-steps", type=int, default=15)
    parser.add_argument("--length", type=int, default=40, help="the trained prompt length")
    parser.add_argument("--long-length", type=int, default=160, help="the longer held-out length")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--warm", default=None, help="the warm-up directory (default runs/<task>/warmup)")
    parser.add_argument("--work", default=None, help="the runs' directory (default runs/<task>/study)")
    parser.add_argument("--json", default=None, help="default bench/results/<TASKS' name>.json")
    parser.add_argument("--plot", default=None, help="default bench/<TASKS' name>.png")
    parser.add_argument("--reuse", action="store_true", help="keep runs that already wrote their result.json")
    parser.add_argument("--replot", action="store_true", help="only redraw the plot (and the table) from --json")
    parser.add_argument("--gradient", action="store_true",
                        help="only measure where one step's gradient lands (gradient_reach) on both reread_hint "
                             "warm-ups (runs/reread_hint/warmup, runs/reread_hint_gdn/warmup), seeds --seeds; writes "
                             "bench/results/exact_pays_hint_gdn_gradient.json")
    parser.add_argument("overrides", nargs="*", help="run-config overrides for every run, e.g. data.groups_per_rank=4")
    args = parser.parse_args()
    _, runs_dir, name = TASKS[args.task]
    args.warm = args.warm or str(ROOT / "runs" / runs_dir / "warmup")
    args.work = args.work or str(ROOT / "runs" / runs_dir / "study")
    args.json = args.json or str(ROOT / "bench" / "results" / f"{name}.json")
    args.plot = args.plot or str(ROOT / "bench" / f"{name}.png")
    if args.gradient:
        import torch

        torch.set_num_threads(1)
        out = {}
        for task in ("reread_hint", "reread_hint_gdn"):
            warm = ROOT / "runs" / TASKS[task][1] / "warmup"
            out[task] = [gradient_reach(warm, seed=int(seed), length=args.length) for seed in args.seeds.split(",")]
            for r in out[task]:
                print(task, "seed", r["seed"], "cosine", r["cosine"], {m: {k: r["norms"][m][k] for k in
                      ("embedding '!'", "embedding, values", "all")} for m in MODES})
        path = ROOT / "bench" / "results" / "exact_pays_hint_gdn_gradient.json"
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")
        return
    if args.replot:
        study = json.loads(Path(args.json).read_text())
        plot(study, args.plot)
        print(table(study))
        return
    import torch

    torch.set_num_threads(1)
    from ds_longstraw.tasks import recall_demo, reread, reread_hint

    started = time.perf_counter()

    def progress(line):
        print(f"[{time.perf_counter() - started:6.0f} s] {line}", flush=True)

    if args.task == "reread":
        warm, warm_info = recall_demo.warm_checkpoint(args.warm, log=progress, task=reread, short=reread.WARMUP_SIZES,
                                                      recipe=reread.WARMUP, eval_lengths=reread.WARMUP_EVAL_LENGTHS)
        progress(f"warm-up {warm} ({warm_info['build_seconds']:.0f} s): '? k' accuracy "
                 f"{warm_info['accuracy_by_length']}")
    else:
        shape = reread_hint.GDN_SHAPE if args.task == "reread_hint_gdn" else None
        warm, warm_info = reread_hint.warm_checkpoint(args.warm, log=progress, shape=shape)
        progress(f"warm-up {warm} ({warm_info['build_seconds']:.0f} s): levels {warm_info['levels']}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    lrs = [float(x) for x in args.lrs.split(",")]
    sweep, chosen = [], {}
    if len(lrs) > 1 and args.sweep_steps > 0:
        for lr in lrs:
            names = [f"sweep_{mode}_lr{lr:g}" for mode in MODES]
            run_pair([grpo_job(work, name, warm, mode, SWEEP_SEED, args.sweep_steps, lr, args)
                      for name, mode in zip(names, MODES, strict=True) if not done(work, name, args)], 1)
            for name in names:
                run = load(work, name)
                sweep.append({"prefix_grad": run["prefix_grad"], "lr": lr, "evals": run["evals"],
                              "clock": run["clock"], "criterion": round(final_accuracy(run, args.length), 4)})
                progress(f"sweep {run['prefix_grad']} lr {lr:g}: accuracy@{args.length} "
                         + " ".join(f"{e['accuracy'][str(args.length)]:.2f}" for e in run["evals"])
                         + f" -> criterion {sweep[-1]['criterion']:.3f}")
        for mode in MODES:
            best = max((s for s in sweep if s["prefix_grad"] == mode), key=lambda s: (s["criterion"], -s["lr"]))
            chosen[mode] = best["lr"]
    else:
        chosen = {mode: lrs[0] for mode in MODES}
    progress(f"learning rates: {chosen}")
    seeds = [int(s) for s in args.seeds.split(",")]
    for seed in seeds:
        run_pair([grpo_job(work, f"{mode}_seed{seed}", warm, mode, seed, args.steps, chosen[mode], args)
                  for mode in MODES if not done(work, f"{mode}_seed{seed}", args)], 1)
        for mode in MODES:
            run = load(work, f"{mode}_seed{seed}")
            progress(f"{mode} seed {seed} (lr {chosen[mode]:g}): accuracy@{args.length} "
                     + " ".join(f"{e['accuracy'][str(args.length)]:.2f}" for e in run["evals"])
                     + f"; @{args.long_length} {run['evals'][-1]['accuracy'][str(args.long_length)]:.3f} at the end; "
                     f"{run['total_seconds'] / len(run['steps']):.2f} s/step")
    runs = [load(work, f"{mode}_seed{seed}") for seed in seeds for mode in MODES]
    sizes = runs[0]["prompt_args"]
    lengths = (args.length, args.long_length)
    # a seed's fixed seconds: the shorter total of its two runs (they ran side by side, under the same load; the
    # machine's load differed between seeds, so one clock for all seeds would compare different loads)
    seconds_budget = {seed: min(r["total_seconds"] for r in runs if r["seed"] == seed) for seed in seeds}
    study = {"task": args.task, "length": args.length, "long_length": args.long_length, "steps": args.steps,
             "seeds": seeds,
             "warmup": warm_info, "lrs": lrs, "sweep_steps": args.sweep_steps, "sweep_seed": SWEEP_SEED,
             "chosen_lr": chosen, "sweep": sweep, "overrides": args.overrides,
             "levels": {"chance": 1 / sizes["values"], "random_record": 1 / sizes["records"],
                        "warmup": {str(n): runs[0]["evals"][0]["accuracy"][str(n)] for n in lengths}},
             "summary": summarise(runs, lengths, args.steps, seconds_budget),
             "wall_seconds": round(time.perf_counter() - started), "runs": runs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(study, indent=1))
    plot(study, args.plot)
    for mode in MODES:
        s = study["summary"][mode]
        progress(f"{mode} (lr {s['lr']:g}): at {args.steps} steps "
                 + ", ".join(f"@{n} {s['at_steps'][str(n)]['mean']:.3f} [{s['at_steps'][str(n)]['min']:.3f}, "
                             f"{s['at_steps'][str(n)]['max']:.3f}]" for n in lengths)
                 + "; at equal seconds "
                 + ", ".join(f"@{n} {s['at_seconds'][str(n)]['mean']:.3f}" for n in lengths)
                 + f"; {s['seconds_per_step']['mean']:.2f} s/step")
    print(table(study))
    progress(f"wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()
