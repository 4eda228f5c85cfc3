#!/usr/bin/env bash
# On-policy distillation with the learning recipe's task and models (docs/distill.md): a teacher larger than the
# student is SFT-trained on clean column-addition traces (no dropped carries), then the student (GPU: the ~55M
# `small` preset) learns from random init by pure distillation: it samples, the teacher scores every sampled token,
# and the per-token reverse KL is the advantage (configs/learn_add_distill*.yaml). Held-out accuracy (greedy, the
# val split no stage trains on) every `trainer.test_freq` steps, against the teacher's own.
#
#   bash examples/learn/distill.sh gpu     # one GPU: ~7 minutes on an H200 (DEVICE_LIMIT_S bounds it)
#   bash examples/learn/distill.sh cpu     # two CPU cores: the CPU learning recipe's sizes (~11 s a student step)
#
#   RUN_DIR   where the data, the models and the runs go (default outputs/distill_<scale>)
#   EXPORT    the small results (default $OUT, else $RUN_DIR/export): 4 flat files, distill_curves.png,
#             summary.json (the teacher's held-out accuracy, the student's by step with its training seconds, the
#             stages' end times), student_metrics.jsonl, log_tail.txt
#   DEVICE_T0 / DEVICE_LIMIT_S   `date +%s` at the start and the seconds allowed (default now / 470): the
#             distillation run is stopped in time to draw and export what it logged
set -euo pipefail
cd "$(dirname "$0")/../.."

SCALE=${1:-gpu}
PYTHON=${PYTHON:-python3}
RUN_DIR=${RUN_DIR:-outputs/distill_$SCALE}
EXPORT=${EXPORT:-${OUT:-$RUN_DIR/export}}
DEVICE_T0=${DEVICE_T0:-$(date +%s)}
DEVICE_LIMIT_S=${DEVICE_LIMIT_S:-470}
case "$SCALE" in
  gpu) DATA=(--digits 3 --sft-size 50000 --train-size 20000 --val-size 256)  # 3 digits: the teacher fits the slot
       SFT=learn_add_sft; DISTILL=learn_add_distill
       # the teacher: ~2.5x the student (hidden 768, 16 layers, MLP 3072, 12 query / 4 key-value heads of 64)
       TEACHER=(+model.overrides.hidden_size=768 +model.overrides.num_hidden_layers=16
                +model.overrides.intermediate_size=3072 +model.overrides.num_attention_heads=12
                trainer.total_steps=500) ;;
  cpu) DATA=(--digits 2 --sft-size 4000 --train-size 4000 --val-size 128)
       SFT=learn_add_sft_cpu; DISTILL=learn_add_distill_cpu
       export RLTRAIN_TORCH_THREADS=${RLTRAIN_TORCH_THREADS:-2}
       # the teacher: hidden 192, 3 layers (the student: 128, 2)
       TEACHER=(model.overrides.hidden_size=192 +model.overrides.num_hidden_layers=3
                model.overrides.intermediate_size=576 +model.overrides.num_attention_heads=6
                trainer.total_steps=300) ;;
  *) echo "distill.sh: SCALE must be gpu or cpu, got '$SCALE'" >&2; exit 2 ;;
esac
mkdir -p "$RUN_DIR" "$EXPORT"
stamp() { echo "$1 $(( $(date +%s) - DEVICE_T0 ))" >> "$RUN_DIR/timing.txt"; echo "distill.sh: $1 at $(( $(date +%s) - DEVICE_T0 )) s" >&2; }
: > "$RUN_DIR/timing.txt"

# 1. clean demonstrations (drop_carry_p 0), RL prompts, the held-out split, and the BPE tokenizer (never the val file)
$PYTHON -m rltrain.data.arithmetic --task add --out "$RUN_DIR/data" "${DATA[@]}" --drop-carry-p 0
$PYTHON tools/train_tokenizer.py --files "$RUN_DIR/data/sft.jsonl" "$RUN_DIR/data/train.jsonl" \
  --out "$RUN_DIR/tokenizer" --vocab-size 512
stamp data

# 2. the teacher: SFT from random init on the clean traces
# (bounded: the student needs the last ~2 minutes; the SFT writes its model at its end only)
timeout --kill-after=10 $(( DEVICE_LIMIT_S - ($(date +%s) - DEVICE_T0) - 120 )) \
  $PYTHON -m rltrain.sft --config-name "$SFT" model.tokenizer="$RUN_DIR/tokenizer" \
  "data.train_files=[$RUN_DIR/data/sft.jsonl]" trainer.output_dir="$RUN_DIR/teacher" trainer.progress_bar=false \
  trainer.logger=[jsonl] "${TEACHER[@]}" hydra.run.dir="$RUN_DIR/teacher_sft" > "$RUN_DIR/teacher_sft.log" 2>&1
stamp teacher_sft
DISTILL_ARGS=(teacher.path="$RUN_DIR/teacher" model.tokenizer="$RUN_DIR/tokenizer"
              "data.train_files=[$RUN_DIR/data/train.jsonl]" "data.val_files=[$RUN_DIR/data/val.jsonl]")
# the teacher's held-out accuracy, as the trainer's validation measures the student's (rltrain/trainer/evaluate.py)
$PYTHON - "$DISTILL" "$RUN_DIR/teacher" "$RUN_DIR/teacher_eval.json" "${DISTILL_ARGS[@]}" <<'EOF'
import json, sys
from rltrain.config.entry import compose_config
from rltrain.trainer.evaluate import evaluate
name, teacher, out, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
cfg = compose_config(name, [*overrides, f"model.path={teacher}", "model.builtin=null", "model.tokenizer=null"])
res = evaluate(cfg, batch=512, tool_workers=1)
json.dump(res, open(out, "w"), indent=1)
print(f"distill.sh: the teacher's held-out accuracy {res['accuracy']:.3f} (n={res['n']})", file=sys.stderr)
EOF
stamp teacher_eval

# 3. the student from random init, distilled; stopped in time to draw and export what it logged
LEFT=$(( DEVICE_LIMIT_S - ($(date +%s) - DEVICE_T0) - 35 ))
[ "$LEFT" -ge 30 ] || { echo "distill.sh: only ${LEFT} s left for the student; raise DEVICE_LIMIT_S" >&2; exit 3; }
status=0
timeout --signal=INT --kill-after=15 "$LEFT" $PYTHON -m rltrain.main --config-name "$DISTILL" "${DISTILL_ARGS[@]}" \
  trainer.logger=[console,jsonl] trainer.progress_bar=false hydra.run.dir="$RUN_DIR/student" \
  > "$RUN_DIR/student.log" 2>&1 || status=$?
stamp "student(exit=$status)"

# 4. four files: the student's curves (by step and by wall clock), the summary, its metrics, the logs' tails
$PYTHON -m rltrain.utils.plotting "$RUN_DIR/student" --labels "student (distilled)" --out "$EXPORT/distill_curves.png" \
  || true
cp "$RUN_DIR/student/metrics.jsonl" "$EXPORT/student_metrics.jsonl" || true
{ tail -c 5000 "$RUN_DIR/teacher_sft.log"; echo; echo "=== student ==="; tail -c 15000 "$RUN_DIR/student.log"; } \
  > "$EXPORT/log_tail.txt" 2>/dev/null || true
$PYTHON - "$RUN_DIR" "$EXPORT/summary.json" <<'EOF' || true
import json, os, sys
run, out = sys.argv[1], sys.argv[2]
from rltrain.utils.tracking import read_metrics
teacher = json.load(open(os.path.join(run, "teacher_eval.json")))
stamps = [line.split() for line in open(os.path.join(run, "timing.txt")) if line.strip()]
curve, seconds = [], 0.0
for r in read_metrics(os.path.join(run, "student")):
    seconds += r.get("timing_s/step", 0.0)
    if "val/accuracy" in r:
        curve.append({"step": r["step"], "accuracy": r["val/accuracy"], "train_s": round(seconds, 1),
                      "reverse_kl_mean": r.get("distill/reverse_kl/mean"), "teacher_s": r.get("timing_s/teacher")})
target = 0.9 * teacher["accuracy"]
first = next((c for c in curve if c["accuracy"] >= target), None)
res = {"teacher_accuracy": teacher["accuracy"], "target_0.9": target, "student_first_at_target": first,
       "student_curve": curve, "stamps_s": {k: int(v) for k, v in stamps}}
json.dump(res, open(out, "w"), indent=1)
print(f"distill.sh: teacher {teacher['accuracy']:.3f}; student "
      + " ".join(f"{c['step']}:{c['accuracy']:.3f}@{c['train_s']:.0f}s" for c in curve)
      + f"; 90% of the teacher first at {first}", file=sys.stderr)
EOF
exit "$status"
