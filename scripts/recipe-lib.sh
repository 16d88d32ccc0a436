# Shared helpers of the recipes: log for every recipe (run-multi30k.sh,
# run-gec-demo.sh, run-wmt.sh); train and raw_multi30k for the CPU recipes.
# Needs: OUT (run directory), T0 (start time, seconds), LOG_TAG (log prefix).

log() { echo "[$LOG_TAG $(date +%H:%M:%S) +$(( ($(date +%s) - T0) / 60 ))m] $*"; }

hours() { awk -v m="$1" 'BEGIN { printf "%.4f", m / 60 }'; }

# quote ARG...: the arguments shell-quoted, on one line (what a dry run prints)
quote() { local out="" a; for a in "$@"; do out+="$(printf '%q' "$a") "; done; printf '%s' "${out% }"; }

# device_flag: --cpu when the config says DEVICE=cpu (the default), nothing
# on a GPU (DEVICE=gpu); use it unquoted: $(device_flag)
device_flag() { if [ "${DEVICE:-cpu}" = cpu ]; then echo --cpu; fi; }

# train NAME UPDATES MINUTES DATA_DIR ARGS...: one resumable fairseq-train run
# into $OUT/NAME (log $OUT/NAME.log), budgeted by UPDATES (--max-update, seeded)
# so that the model is the same on any machine; MINUTES is only a safety cap
# (--stop-time-hours) and the log says so when it cut the run short.  Skipped
# once $OUT/NAME/DONE exists.  fairseq counts --stop-time-hours over restarts,
# so an interrupted run resumes from checkpoint_last.pt with the time it has
# left.  The plugin is always loaded: without it, torch's safe loader refuses
# fairseq's own checkpoints, so even a plain `--task translation` run could not
# resume.  --cpu only when DEVICE=cpu (device_flag).  With DRY_RUN=1 it prints
# the command (shell-quoted) with its budget instead of running it.
train() {
  local name=$1 updates=$2 minutes=$3 data=$4; shift 4
  local cmd=(fairseq-train "$data" --user-dir "$HERE/fairseq_specdec" "$@" --save-dir "$OUT/$name" $(device_flag)
             --max-update "$updates" --stop-time-hours "$(hours "$minutes")" --log-format simple --log-interval 50
             --num-workers 0 --seed 1)
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "# $name: $updates updates, at most $minutes minutes"
    echo "$(quote "${cmd[@]}") >> $(quote "$OUT/$name.log") 2>&1"
    return
  fi
  if [ -f "$OUT/$name/DONE" ]; then log "$name: done before"; return; fi
  log "$name: training for $updates updates, at most $minutes minutes (log: $OUT/$name.log)"
  "${cmd[@]}" >> "$OUT/$name.log" 2>&1
  grep "valid on" "$OUT/$name.log" | tail -2 | sed 's/^/  /'
  local done_updates
  done_updates=$(sed -n 's/.*| num_updates \([0-9]*\).*/\1/p' "$OUT/$name.log" | tail -1)
  if [ "${done_updates:-0}" -lt "$updates" ]; then
    log "WARNING: $name stopped by the $minutes-minute safety cap at ${done_updates:-0} of $updates updates:" \
        "this model is weaker than the recipe's, and figures from it will not match the README"
  fi
  touch "$OUT/$name/DONE"
}

# raw_multi30k: the directory of the raw Multi30k files (see prepare-multi30k.sh)
raw_multi30k() {
  if [ -n "${MULTI30K_RAW:-}" ]; then echo "$MULTI30K_RAW"; return; fi
  local shared; shared="$(cd "$HERE/.." && pwd)/shared/data/multi30k"
  if [ -d "$shared" ]; then echo "$shared"; else echo "$HERE/data/multi30k-raw"; fi
}
