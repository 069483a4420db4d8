# limit: 150
# A SmolLM2 held-out check (64 prompts x 128 tokens, random weights at its shapes) as the recipe runs it, with
# the engine's default buckets (eager steps past 8 requests) and with every batch size in a graph (the
# recipe's --graph-buckets batch), captures counted: does graphing the checks and the evaluation pay?
python3 "$REPO/experiments/smollm2_profile.py" --pieces checks --out "$JOB_OUT/smollm2_profile_checks.json" 2>&1 \
  | grep -E "^held_out|error|Error"
