"""`vlmrl reclip train | eval | export`: the contrastive track's command line (console output lives here)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TRAIN_HELP = """Train a two-tower student with ReCLIP: an InfoNCE warm-start, then REINFORCE on retrievals judged in
words by a generative reward model, from a YAML recipe plus dotted overrides.

Examples:
  vlmrl reclip train                                        # the default recipe: embedded towers, built-in scenes
  vlmrl reclip train recipes/reclip_shapes.yaml rl.steps=100 trainer.threads=1
  vlmrl reclip train recipes/reclip_shapes.yaml rl.method=infonce   # the continued-InfoNCE baseline
Every key: `vlmrl reclip train --show-config`; docs/reclip.md explains them."""

EVAL_HELP = """Evaluate STUDENT (RUN_DIR/student, any saved student, or a CLIP/SigLIP folder) on its run's held-out
data (RUN_DIR/config.yaml) or on --data; or, with --zeroshot and/or --captions, on your own files:

  vlmrl reclip eval runs/reclip/student --zeroshot data/pets/val --templates templates.txt --out zs.json
  vlmrl reclip eval runs/reclip/student --captions dataset_flickr30k.json --image-root flickr30k-images --out r.json

--zeroshot: top-1/top-5 accuracy with 95% intervals and per-class accuracy; --captions: R@1/5/10 both ways with 95%
intervals (several captions per image). Images that cannot be loaded are skipped and counted. File layouts:
docs/reclip.md ("Evaluating on your own files")."""

METRICS = ("t2i/R@1", "t2i/R@5", "t2i/R@10", "i2t/R@1", "i2t/R@5", "i2t/R@10", "t2i/semantic_R@1", "comp/acc",
           "comp/relation", "comp/binding", "comp/color", "comp/shape", "comp/count", "comp/all", "zeroshot/colour",
           "zeroshot/shape", "zeroshot/count", "zeroshot/mean")


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, list(args)


def _table(columns: dict[str, dict[str, float]]) -> str:
    names = list(columns)
    keys = [k for k in METRICS if any(k in c for c in columns.values())]
    keys += sorted({k for c in columns.values() for k in c} - set(keys))
    lines = [f"{'held-out':<20}" + "".join(f"{n:>14}" for n in names)]
    for key in keys:
        cells = "".join(f"{100 * columns[n][key]:13.1f}%" if key in columns[n] else f"{'-':>14}" for n in names)
        lines.append(f"{key:<20}{cells}")
    return "\n".join(lines)


def cmd_train(args) -> int:
    from vlmrl.config import to_dict
    from vlmrl.reclip.config import load_reclip_config

    recipe, overrides = _split_args(args.args)
    cfg = load_reclip_config(recipe, overrides)  # a typo fails here, before anything is built
    if args.show_config:
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    import os

    from vlmrl.progress import BarProgress
    from vlmrl.reclip.trainer import train_reclip
    from vlmrl.trainer.run import Progress

    summary = train_reclip(cfg, BarProgress() if os.environ.get("RANK", "0") == "0" else Progress())
    if summary["rank"] != 0:  # under torchrun rank 0 reports
        return 0
    print(f"\nrun directory: {summary['run_dir']}")
    print(_table({"warm-start": summary["start"], f"after {cfg.rl.method}": summary["final"]}))
    print(f"wall time: {summary['wall_seconds']:.0f} s; student: {summary.get('student', '(not saved)')}")
    return 0


def _zeroshot_table(res: dict) -> str:
    from vlmrl.eval.metrics import format_interval

    head = (f"zero-shot classification: {res['data']} ({res['classes']} classes, {len(res['templates'])} templates, "
            f"{res['n']} images; skipped: {res['skipped_images']} that did not load)")
    lines = [head] + [f"  top-{k:<4}{format_interval(res[f'top{k}'], res[f'top{k}_ci_low'], res[f'top{k}_ci_high'])}"
                      for k in (1, 5) if f"top{k}" in res]
    lines.append(f"  mean per-class top-1: {100 * res['per_class_mean_top1']:.1f}%")
    if len(res["per_class"]) <= 30:
        lines.append(f"  {'class':<24}{'n':>6}{'top-1':>9}")
        for name, row in res["per_class"].items():
            cell = "-" if row["top1"] is None else f"{100 * row['top1']:.1f}%"
            lines.append(f"  {name[:24]:<24}{row['n']:>6}{cell:>9}")
    else:
        lines.append("  (per-class accuracy: in --out)")
    return "\n".join(lines)


def _retrieval_table(res: dict) -> str:
    from vlmrl.eval.metrics import format_interval

    ks = [int(key.split("@")[1]) for key in res if key.startswith("i2t/R@") and not key.endswith(("_low", "_high"))]
    head = (f"image-text retrieval: {res['data']} split {res['split']} ({res['images']} images, {res['captions']} "
            f"captions; skipped: {res['skipped_images']} image(s) that did not load, with {res['skipped_captions']} "
            "caption(s))")
    lines = [head, "  " + "".join(f"{f'R@{k}':>22}" for k in ks)]
    for way in ("i2t", "t2i"):
        cells = "".join(f"{format_interval(*(res[f'{way}/R@{k}{x}'] for x in ('', '_ci_low', '_ci_high'))):>22}"
                        for k in ks)
        lines.append(f"  {way}{cells}")
    return "\n".join(lines)


def _eval_files(args, cfg) -> int:
    """`vlmrl reclip eval STUDENT --zeroshot FOLDER / --captions FILE`: the evaluations on the user's own files. Both
    are read (and a layout error reported) before the student loads."""
    from vlmrl.reclip import retrieval, zeroshot
    from vlmrl.reclip.students import load_student

    folder = captions = None
    if args.zeroshot:
        folder = zeroshot.image_folder(args.zeroshot, zeroshot.read_classes(args.classes) if args.classes else None)
        templates = zeroshot.read_templates(args.templates) if args.templates else zeroshot.DEFAULT_TEMPLATES
    if args.captions:
        captions = retrieval.read_caption_file(args.captions, args.image_root, args.caption_split)
    student = load_student(args.student)
    results: dict = {}
    if folder is not None:
        print(f"zero-shot: {len(folder.paths)} images, {len(folder.names)} classes x {len(templates)} templates",
              file=sys.stderr)
        res = zeroshot.zero_shot_classification(student, folder, templates, cfg.eval.batch_size)
        results["zeroshot"] = {"data": args.zeroshot, **res}
        print(_zeroshot_table(results["zeroshot"]))
    if captions is not None:
        print(f"retrieval: {len(captions.paths)} images, {sum(map(len, captions.captions))} captions", file=sys.stderr)
        res = retrieval.caption_retrieval(student, captions, cfg.eval.ks, cfg.eval.batch_size)
        results["retrieval"] = {"data": args.captions, "split": args.caption_split, **res}
        print(_retrieval_table(results["retrieval"]))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


def cmd_eval(args) -> int:
    from vlmrl.errors import ConfigError
    from vlmrl.reclip.config import load_reclip_config
    from vlmrl.reclip.data import build_items, zero_shot_sets
    from vlmrl.reclip.evaluate import evaluate_student
    from vlmrl.reclip.students import load_student

    folder = Path(args.student)
    recipe = folder.parent / "config.yaml" if (folder.parent / "config.yaml").exists() else None
    cfg = load_reclip_config(recipe, args.overrides)
    for flag, needs in (("classes", "zeroshot"), ("templates", "zeroshot"), ("image_root", "captions")):
        if getattr(args, flag) and not getattr(args, needs):
            raise ConfigError(f"--{flag.replace('_', '-')} goes with --{needs}")
    if args.zeroshot or args.captions:
        if args.data:
            raise ConfigError("--data (held-out captioned items) and --zeroshot / --captions are separate "
                              "evaluations; run them one at a time")
        return _eval_files(args, cfg)
    spec = cfg.data.eval
    if args.data:
        spec = {"path": args.data} if Path(args.data).exists() else {"task": args.data, "n": args.n or 300}
    elif args.n and isinstance(spec, dict) and "task" in spec:
        spec = {**spec, "n": args.n}
    items, report = build_items(spec, args.split, cfg.data.seed, cfg.data.on_error)
    if report is not None and report.skipped:
        print(f"{report.path}: skipped {report.skipped} bad rows", file=sys.stderr)
    student = load_student(folder)
    scenes = all(it.description is not None for it in items)
    zs = zero_shot_sets(150, cfg.data.seed) if cfg.eval.zero_shot and scenes else []
    metrics = evaluate_student(student, items, zs, cfg.eval.ks, cfg.eval.templates, cfg.eval.batch_size)
    print(_table({folder.name: metrics}))
    if args.out:
        Path(args.out).write_text(json.dumps(metrics, indent=2))
    return 0


def cmd_export(args) -> int:
    from vlmrl.reclip.students import load_student

    student = load_student(args.student)
    out = student.save_pretrained(args.out)
    print(f"wrote {out}: load it with vlmrl.reclip.load_student({str(out)!r}); it has encode_text / encode_image"
          + ("; CLIPModel/SiglipModel.from_pretrained also load it" if student.kind == "hf" else ""))
    return 0


GRM_HELP = """Make a generative reward model with vlmrl (docs/reclip.md, "Train your own judge"):

  vlmrl reclip grm-data data/grm                    # judged retrievals of the built-in scenes as data files
  vlmrl train recipes/reclip_grm.yaml               # SFT + RL paid by agreement with the programmatic judge
  vlmrl serve runs/reclip_grm --port 8001
  vlmrl reclip grm-eval --base-url http://127.0.0.1:8001/v1 --model reclip_grm
  vlmrl reclip train recipes/reclip_learned_judge.yaml    # ReCLIP with that judge (its URL in the recipe)"""


def cmd_grm_data(args) -> int:
    from vlmrl.reclip.grm import judged_retrievals, write_rows
    from vlmrl.reclip.scenes import make_scenes

    out = Path(args.out)
    for split, n, items, scene_split in (("train", args.train, args.items, "train"),
                                         ("eval", args.eval, 300, "test")):
        rows = judged_retrievals(make_scenes(items, scene_split, args.seed), n, args.seed)
        path = write_rows(rows, out, split)
        kinds = {k: sum(r.kind == k for r in rows) for k in ("truth", "near", "random")}
        print(f"wrote {path}: {n} judged retrievals among {items} {scene_split} scenes ({kinds})")
    return 0


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _auc(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _grm_table(res: dict) -> str:
    from vlmrl.eval.metrics import format_interval

    lines = [f"agreement with the programmatic judge on {res['n']} held-out retrievals "
             f"(failed judgements: {res['failed']}, replies without a verdict: {res['no_verdict']})",
             f"  verdict agreement  {format_interval(res['verdict_agreement'], res['verdict_ci_low'], res['verdict_ci_high'])}"
             f"   kappa {res['kappa']:.2f}   exact (verdict and every reason) {100 * res['exact']:.1f}%",
             f"  reasons            precision {_pct(res['reason_precision'])}   recall "
             f"{_pct(res['reason_recall'])}   F1 {_pct(res['reason_f1'])}",
             "  recall by attribute: " + ", ".join(f"{a} {100 * v:.0f}%" for a, v in res["recall_by_attribute"].items())]
    if res["graded"]:
        lines.append(f"  graded ({res['graded']} with P(relevant), {_pct(res['uncertain'])} between 0.01 and 0.99): "
                     f"ROC AUC {_auc(res['auc_probability'])} (the tag alone {_auc(res['auc_tag'])}), Brier "
                     f"{res['brier']:.3f}")
    for group in ("by_kind", "by_direction"):
        for name, sub in res[group].items():
            lines.append(f"  {name:<8} n={sub['n']:<5} verdict {100 * sub['verdict_agreement']:.1f}%   reason F1 "
                         f"{_pct(sub['reason_f1'])}   exact {100 * sub['exact']:.1f}%")
    lines += [f"  error: {e}" for e in res["errors"]]
    return "\n".join(lines)


def cmd_grm_eval(args) -> int:
    from vlmrl.reclip.grm import GRM_TEMPLATE, MAX_REASONS, held_out_agreement
    from vlmrl.reclip.judge import build_judge

    if args.programmatic:
        judge = build_judge("scene_graph")
    else:
        if not (args.base_url and args.model):
            from vlmrl.errors import ConfigError

            raise ConfigError("grm-eval needs --base-url and --model (the served judge), or --programmatic")
        judge = build_judge("llm", {"base_url": args.base_url, "model": args.model,
                                    "template": args.template or GRM_TEMPLATE, "max_reasons": MAX_REASONS,
                                    "max_tokens": args.max_tokens, "cache_dir": None,
                                    "concurrency": args.concurrency, "graded": args.graded})
    res = held_out_agreement(judge, args.n, args.seed, concurrency=args.concurrency)
    print(_grm_table(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


def add_parser(subparsers) -> None:
    """Add `reclip` with its `train`, `eval`, `export`, `grm-data` and `grm-eval` subcommands to the `vlmrl`
    parser."""
    r = subparsers.add_parser("reclip", help="train and evaluate CLIP-style two-tower students with ReCLIP")
    sub = r.add_subparsers(dest="reclip_command", required=True)
    t = sub.add_parser("train", help="InfoNCE warm-start + ReCLIP (or continued InfoNCE) on a recipe",
                       description=TRAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("args", nargs="*", metavar="[RECIPE] [KEY=VALUE ...]",
                   help="a YAML recipe (optional) followed by dotted overrides such as rl.steps=100")
    t.add_argument("--show-config", action="store_true", help="print the resolved config and exit")
    t.set_defaults(func=cmd_train)
    e = sub.add_parser("eval", help="retrieval R@k, compositional and zero-shot accuracy of a saved student",
                       description=EVAL_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("student")
    e.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides (e.g. data.eval.n=100)")
    e.add_argument("--data", help="reclip_scenes, or an image-caption JSONL/parquet file")
    e.add_argument("--split", default="test", choices=["train", "test", "ood"], help="split of the built-in scenes")
    e.add_argument("--n", type=int, default=0, help="number of built-in scenes")
    e.add_argument("--out", help="also write the metrics as JSON here")
    e.add_argument("--zeroshot", metavar="FOLDER", help="zero-shot classification of FOLDER/<class>/<images>")
    e.add_argument("--classes", metavar="FILE", help="with --zeroshot: YAML/JSON mapping class folder -> class name "
                                                     "(default: the folder name, '_' read as a space)")
    e.add_argument("--templates", metavar="FILE", help="with --zeroshot: prompt templates, one per line with {} "
                                                       "for the class name (default: 7 CLIP photo templates)")
    e.add_argument("--captions", metavar="FILE", help="image-text retrieval on a Karpathy split JSON "
                                                      "(dataset_coco.json) or a JSONL of {image, captions}")
    e.add_argument("--image-root", help="with --captions: folder the image paths are relative to (default: the "
                                        "caption file's folder)")
    e.add_argument("--caption-split", default="test",
                   help="with --captions: entries whose 'split' is this are kept (default test; 'all' keeps every one)")
    e.set_defaults(func=cmd_eval)
    x = sub.add_parser("export", help="write a student as a standalone folder with encode_text / encode_image")
    x.add_argument("student", help="RUN_DIR/student or any saved student")
    x.add_argument("out")
    x.set_defaults(func=cmd_export)
    g = sub.add_parser("grm-data", help="judged retrievals of the built-in scenes as data files (a judge to train)",
                       description=GRM_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("out", help="folder for train.jsonl, eval.jsonl and images/")
    g.add_argument("--train", type=int, default=8000, help="training rows (retrievals among --items train scenes)")
    g.add_argument("--eval", type=int, default=500, help="held-out rows (among 300 held-out scenes)")
    g.add_argument("--items", type=int, default=2000, help="train scenes the retrievals are drawn among")
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=cmd_grm_data)
    a = sub.add_parser("grm-eval", help="a judge's agreement with the programmatic judge on held-out retrievals",
                       description=GRM_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--base-url", help="the served judge's OpenAI-compatible base URL (.../v1)")
    a.add_argument("--model", help="the model name the server answers to")
    a.add_argument("--template", help="the judge prompt (default: the one grm-data writes)")
    a.add_argument("--programmatic", action="store_true", help="evaluate the programmatic judge itself (a check)")
    a.add_argument("--graded", action="store_true",
                   help="ask for token log-probs and also rank by the judge's P(relevant) (ROC AUC, Brier)")
    a.add_argument("--n", type=int, default=500, help="held-out retrievals")
    a.add_argument("--seed", type=int, default=1, help="held-out retrievals' seed (grm-data's eval rows use 0)")
    a.add_argument("--max-tokens", type=int, default=64)
    a.add_argument("--concurrency", type=int, default=16)
    a.add_argument("--out", help="also write the numbers as JSON here")
    a.set_defaults(func=cmd_grm_eval)
