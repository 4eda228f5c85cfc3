#!/usr/bin/env bash
# On-policy distillation with the learning recipe's task and models (docs/distill.md): a teacher larger than the
# student is SFT-trained on clean column-addition traces (no dropped carries); the student (GPU: the ~55M `small`
# preset) starts from a weak checkpoint, SFT-trained briefly on the sloppy traces (carries dropped, as the learning
# recipe's GRPO stage starts), and learns by pure distillation: it samples, the teacher scores every sampled token,
# and the per-token reverse KL is the advantage (configs/learn_add_distill*.yaml). GRPO from the same start, with the
# same settings but the reward's advantage, runs at the same time on the same device, so the two compare by step and
# by wall clock. Held-out accuracy (greedy, the val split no stage trains on) every `trainer.test_freq` steps,
# against the teacher's own. (From random init the student samples junk that the teacher's log-probs say little
# about, and it did not learn: docs/distill.md.)
#
#   bash examples/learn/distill.sh gpu     # one GPU: ~8.5 minutes on an H200 (DEVICE_LIMIT_S bounds it)
#   bash examples/learn/distill.sh cpu     # two CPU cores: the CPU learning recipe's sizes (~10 s a student step)
#
#   RUN_DIR   where the data, the models and the runs go (default outputs/distill_<scale>)
#   EXPORT    the small results (default $OUT, else $RUN_DIR/export): 4 flat files, distill_curves.png (distillation
#             and GRPO, by step and by wall clock), summary.json (the teacher's and the start's held-out accuracy,
#             each run's by step with its training seconds, the first point at 90% of the teacher, the stages' end
#             times), metrics.tar.gz (both runs' metrics.jsonl), log_tail.txt
#   DEVICE_T0 / DEVICE_LIMIT_S   `date +%s` at the start and the seconds allowed (default now / 520 on gpu, where
#             the two runs go on until they are stopped in time to draw and export what they logged; cpu: 20 steps)
#   STUDENT_SFT_STEPS / TEACHER_SFT_STEPS   the two SFT lengths (defaults per scale below)
#   DISTILL_LRS   the distillation runs' learning rates (default: GRPO's own and one higher, per scale below)
#   MIX_COEFS     GRPO plus distillation runs, one per algorithm.distill_coef (default 0.5; empty: none)
set -euo pipefail
cd "$(dirname "$0")/../.."

SCALE=${1:-gpu}
PYTHON=${PYTHON:-python3}
RUN_DIR=${RUN_DIR:-outputs/distill_$SCALE}
EXPORT=${EXPORT:-${OUT:-$RUN_DIR/export}}
DEVICE_T0=${DEVICE_T0:-$(date +%s)}
MIX_COEFS=${MIX_COEFS-0.5}
case "$SCALE" in
  gpu) DATA=(--digits 3 --sft-size 50000 --train-size 20000 --val-size 256)  # 3 digits: the teacher fits the slot
       SFT=learn_add_sft; DISTILL=learn_add_distill; GRPO=learn_add_grpo; TEACHER_DTYPE=bfloat16
       # the teacher: ~2.5x the student (hidden 768, 16 layers, MLP 3072, 12 query / 4 key-value heads of 64)
       TEACHER=(+model.overrides.hidden_size=768 +model.overrides.num_hidden_layers=16
                +model.overrides.intermediate_size=3072 +model.overrides.num_attention_heads=12
                trainer.total_steps=${TEACHER_SFT_STEPS:-500})
       STUDENT=(trainer.total_steps=${STUDENT_SFT_STEPS:-500})  # as long as the teacher's: both end together
       # the runs go on until the time is up; four at once (GRPO, distillation at two learning rates, GRPO + it)
       RUN_STEPS=1000; DEVICE_LIMIT_S=${DEVICE_LIMIT_S:-520}; DISTILL_LRS=${DISTILL_LRS:-"2e-5 1e-4"} ;;
  cpu) DATA=(--digits 2 --sft-size 4000 --train-size 4000 --val-size 128)
       SFT=learn_add_sft_cpu; DISTILL=learn_add_distill_cpu; GRPO=learn_add_grpo_cpu; TEACHER_DTYPE=float32
       export RLTRAIN_TORCH_THREADS=${RLTRAIN_TORCH_THREADS:-1}  # the runs go at once on two cores
       # the teacher: hidden 192, 3 layers (the student: 128, 2)
       TEACHER=(model.overrides.hidden_size=192 +model.overrides.num_hidden_layers=3
                model.overrides.intermediate_size=576 +model.overrides.num_attention_heads=6
                trainer.total_steps=${TEACHER_SFT_STEPS:-150})
       STUDENT=(trainer.total_steps=${STUDENT_SFT_STEPS:-150})  # the CPU learning recipe's SFT
       RUN_STEPS=20; DEVICE_LIMIT_S=${DEVICE_LIMIT_S:-3600}; DISTILL_LRS=${DISTILL_LRS:-"5e-5 2e-4"} ;;
  *) echo "distill.sh: SCALE must be gpu or cpu, got '$SCALE'" >&2; exit 2 ;;
esac
mkdir -p "$RUN_DIR" "$EXPORT"
stamp() { echo "$1 $(( $(date +%s) - DEVICE_T0 ))" >> "$RUN_DIR/timing.txt"; echo "distill.sh: $1 at $(( $(date +%s) - DEVICE_T0 )) s" >&2; }
left() { echo $(( DEVICE_LIMIT_S - ($(date +%s) - DEVICE_T0) - $1 )); }
: > "$RUN_DIR/timing.txt"

# 1. clean demonstrations (drop_carry_p 0) for the teacher, sloppy ones (the default drop_carry_p, same problems) for
# the student's start, RL prompts, the held-out split, and the BPE tokenizer (never the val file)
$PYTHON -m rltrain.data.arithmetic --task add --out "$RUN_DIR/data" "${DATA[@]}" --drop-carry-p 0
$PYTHON -m rltrain.data.arithmetic --task add --out "$RUN_DIR/data_sloppy" "${DATA[@]}"
$PYTHON -m rltrain.data.train_tokenizer --files "$RUN_DIR/data/sft.jsonl" "$RUN_DIR/data/train.jsonl" \
  --out "$RUN_DIR/tokenizer" --vocab-size 512
stamp data

# 2. the teacher (clean traces) and the student's start (sloppy traces), SFT from random init, at the same time
# (bounded: the runs need the last ~4 minutes; an SFT writes its model at its end only)
sft() {  # NAME DATA_FILE OVERRIDES...
  local name=$1 file=$2; shift 2
  timeout --kill-after=10 "$(left 240)" $PYTHON -m rltrain.sft --config-name "$SFT" \
    model.tokenizer="$RUN_DIR/tokenizer" "data.train_files=[$file]" trainer.output_dir="$RUN_DIR/$name" \
    trainer.progress_bar=false trainer.logger=[jsonl] "$@" hydra.run.dir="$RUN_DIR/${name}_sft" \
    > "$RUN_DIR/${name}_sft.log" 2>&1
}
sft teacher "$RUN_DIR/data/sft.jsonl" "${TEACHER[@]}" & teacher_pid=$!
sft student0 "$RUN_DIR/data_sloppy/sft.jsonl" "${STUDENT[@]}" & student_pid=$!
sft_failed() { echo "distill.sh: the $1 SFT failed or ran out of time ($RUN_DIR/${1}_sft.log)" >&2; exit 3; }
wait "$teacher_pid" || sft_failed teacher
wait "$student_pid" || sft_failed student0
stamp sft
DATA_ARGS=("data.train_files=[$RUN_DIR/data/train.jsonl]" "data.val_files=[$RUN_DIR/data/val.jsonl]")
RUN_ARGS=(model.path="$RUN_DIR/student0" model.builtin=null model.tokenizer=null "${DATA_ARGS[@]}"
          trainer.total_steps=$RUN_STEPS trainer.test_freq=5 trainer.save_freq=-1 trainer.resume=never
          trainer.export_hf_on_end=false trainer.logger=[console,jsonl] trainer.progress_bar=false)
# the teacher's held-out accuracy, as the trainer's validation measures the student's (rltrain/trainer/evaluate.py)
$PYTHON - "$DISTILL" "$RUN_DIR/teacher" "$RUN_DIR/teacher_eval.json" "${DATA_ARGS[@]}" <<'PY'
import json, sys
from rltrain.config.entry import compose_config
from rltrain.trainer.evaluate import evaluate
name, teacher, out, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
cfg = compose_config(name, [*overrides, f"teacher.path={teacher}", f"model.path={teacher}", "model.builtin=null",
                            "model.tokenizer=null"])
res = evaluate(cfg, batch=512, tool_workers=1)
json.dump(res, open(out, "w"), indent=1)
print(f"distill.sh: the teacher's held-out accuracy {res['accuracy']:.3f} (n={res['n']})", file=sys.stderr)
PY
stamp teacher_eval

# 3. GRPO, distillation (one run per learning rate in DISTILL_LRS; the first is GRPO's own) and GRPO plus
# distillation (MIX_COEFS) from the student's start, all at the same time (each validates before its first step);
# stopped in time to draw and export their logs
LEFT=$(left 40)
[ "$LEFT" -ge 30 ] || { echo "distill.sh: only ${LEFT} s left for the runs; raise DEVICE_LIMIT_S" >&2; exit 3; }
run() {  # NAME CONFIG OVERRIDES...
  local name=$1 config=$2; shift 2
  timeout --signal=INT --kill-after=15 "$LEFT" $PYTHON -m rltrain.main --config-name "$config" "${RUN_ARGS[@]}" "$@" \
    hydra.run.dir="$RUN_DIR/$name" > "$RUN_DIR/$name.log" 2>&1
}
RUNS=(grpo); run grpo "$GRPO" trainer.experiment_name=learn_add_grpo_vs_distill & PIDS=($!)
for lr in $DISTILL_LRS; do
  RUNS+=("distill_lr$lr"); run "distill_lr$lr" "$DISTILL" teacher.path="$RUN_DIR/teacher" actor.lr="$lr" & PIDS+=($!)
done
for coef in $MIX_COEFS; do  # RL plus distillation: GRPO's advantage + coef x the teacher's
  RUNS+=("grpo_distill$coef"); run "grpo_distill$coef" "$GRPO" teacher.path="$RUN_DIR/teacher" \
    teacher.dtype="$TEACHER_DTYPE" algorithm.distill_coef="$coef" & PIDS+=($!)
done
STATUS=(); for pid in "${PIDS[@]}"; do s=0; wait "$pid" || s=$?; STATUS+=("$s"); done
stamp "runs(${RUNS[*]}: ${STATUS[*]})"  # 124: stopped at the time limit (SIGINT), as planned

# 4. four files: the curves (by step and by wall clock), the summary, the metrics, the logs' tails
$PYTHON -m rltrain.utils.plotting "${RUNS[@]/#/$RUN_DIR/}" --labels "${RUNS[@]}" --out "$EXPORT/distill_curves.png" \
  || true
tar -czf "$EXPORT/metrics.tar.gz" -C "$RUN_DIR" "${RUNS[@]/%//metrics.jsonl}" teacher_sft/metrics.jsonl \
  student0_sft/metrics.jsonl timing.txt 2>/dev/null || true
{ for f in teacher_sft student0_sft "${RUNS[@]}"; do echo "=== $f ==="; tail -c 5000 "$RUN_DIR/$f.log"; echo; done; } \
  > "$EXPORT/log_tail.txt" 2>/dev/null || true
$PYTHON - "$RUN_DIR" "$EXPORT/summary.json" "${RUNS[@]}" <<'PY' || true
import json, os, sys
run, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
from rltrain.utils.tracking import read_metrics
teacher = json.load(open(os.path.join(run, "teacher_eval.json")))
stamps = [line.rsplit(maxsplit=1) for line in open(os.path.join(run, "timing.txt")) if line.strip()]
target = 0.9 * teacher["accuracy"]
res = {"teacher_accuracy": teacher["accuracy"], "target_0.9": target, "stamps_s": {k: int(v) for k, v in stamps}}
for name in names:
    curve, seconds = [], 0.0
    for r in read_metrics(os.path.join(run, name)) if os.path.exists(os.path.join(run, name)) else []:
        seconds += r.get("timing_s/step", 0.0)
        if "val/accuracy" in r:
            curve.append({"step": r["step"], "accuracy": r["val/accuracy"], "train_s": round(seconds, 1),
                          "reverse_kl_mean": r.get("distill/reverse_kl/mean"), "teacher_s": r.get("timing_s/teacher")})
    first = next((c for c in curve if c["accuracy"] >= target), None)
    res[name] = {"first_at_target": first, "curve": curve}
    print(f"distill.sh: {name}: " + " ".join(f"{c['step']}:{c['accuracy']:.3f}@{c['train_s']:.0f}s" for c in curve)
          + f"; 90% of the teacher ({target:.3f}) first at {first}", file=sys.stderr)
json.dump(res, open(out, "w"), indent=1)
print(f"distill.sh: teacher {teacher['accuracy']:.3f}", file=sys.stderr)
PY
for s in "${STATUS[@]}"; do [ "$s" = 0 ] || [ "$s" = 124 ] || exit "$s"; done
