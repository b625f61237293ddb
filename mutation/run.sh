#!/usr/bin/env bash
# Mutation testing with cosmic-ray, one module at a time: bash mutation/run.sh NAME...
# NAME is a config in mutation/ (bus_control, bus_discovery, bus_publisher,
# trainer_checkpoint, trainer_control); none runs them all. Each mutant is applied to the
# file in place and the config's test command run; run it from a clean working tree.
# Sessions go to mutation/sessions/NAME.sqlite (git-ignored); `cosmic-ray exec` resumes one.
# SAMPLE=K runs a fixed one-in-K sample of each new session's mutants (see skip_numbers.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
mkdir -p mutation/sessions
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(bus_control bus_discovery trainer_checkpoint trainer_control bus_publisher)
for name in "${names[@]}"; do
    config=mutation/$name.toml
    session=mutation/sessions/$name.sqlite
    if [ ! -f "$session" ]; then
        cosmic-ray init "$config" "$session"
        cr-filter-operators "$session" "$config"
        if grep -q 'line-filter' "$config"; then
            cr-filter-lines --config "$config" "$session"
        fi
        if [ "${SAMPLE:-1}" -gt 1 ]; then
            python mutation/skip_numbers.py "$session" --keep-one-in "$SAMPLE"
        else
            python mutation/skip_numbers.py "$session"
        fi
    fi
    start=$(date +%s)
    nice -n 15 cosmic-ray exec "$config" "$session"
    echo "$name: $(( $(date +%s) - start ))s"
    python mutation/score.py "$session"
done
