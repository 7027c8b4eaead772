#!/usr/bin/env bash
# Runs the README's "On a GPU" quick start as written, on a GPU machine, and writes what happened to $OUT.
#
#   OUT=/tmp/qs bash bench/gpu_quickstart.sh          # from the repository root (~2 min without vLLM, <= 4.5 with)
#   WHEELS=gpuwheels OUT=... bash bench/gpu_quickstart.sh   # offline: also install from these carried wheels
#   PYTHON=.venv/bin/python QUICKSTART_OFFLINE=1 ...        # another interpreter; offline install forced
#
# The code block under "### On a GPU" in README.md is read from the README itself, and each of its lines runs as
# written in the repository root, in a fresh venv that sees the machine's packages (--system-site-packages:
# the image's torch, and vLLM when installed), with three substitutions only:
#   - `MODEL=...` points at a tiny Qwen2 built and SFT'd on add2 here by `relayrl demo`'s SFT phase (no download;
#     a random model earns no add2 reward, and such a run stops as "nothing to learn");
#   - the `pip install` line: when PyPI is unreachable, pip gets --no-index --no-build-isolation (and
#     --find-links $WHEELS), so it resolves relayrl's dependency ranges against the installed packages (the
#     GPU image's torch 2.11 + transformers 5.17: the low ends of pyproject's ranges); without vLLM it installs
#     `.` instead of `.[vllm]`. When that resolution fails (a dependency missing from the image), the failure is
#     recorded and relayrl is installed with --no-deps so the other lines still run;
#   - the vLLM line runs only when `python -c 'import vllm'` works (recorded as skipped otherwise).
# The server started in the background by the serve line is stopped at the end.
#
# Output: $OUT/summary.json (per line: the command, exit code, seconds; package versions; the server's reply),
# $OUT/<n>.log per line, and each run's metrics.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/runs/gpu_quickstart}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/relayrl-quickstart.XXXX)
PY=${PYTHON:-python3}
LOG=$OUT/quickstart.log
exec > >(tee -a "$LOG") 2>&1

say() { echo "[gpu_quickstart $(date +%T)] $*"; }

# ---------------------------------------------------------------- the README block (continuation lines joined)
mapfile -t LINES < <(awk '/^### On a GPU/{f=1} f && /^```bash/{g=1; next} g && /^```/{exit} g{print}' README.md |
    sed -e ':a' -e '/\\$/N; s/\\\n[[:space:]]*/ /; ta')
if [ "${#LINES[@]}" -eq 0 ]; then
    say "no '### On a GPU' bash block in README.md"
    exit 1
fi

# ---------------------------------------------------------------- environment
$PY -m venv --without-pip --system-site-packages "$WORK/venv"
# the venv also sees $PY's own packages when $PY is itself a venv / conda python (a .pth file), and uses $PY's pip
# and setuptools (a venv's bundled setuptools may be too old to build relayrl without build isolation)
$PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"]); print(sysconfig.get_paths()["platlib"])' \
    > "$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_outer.pth"
printf '#!/bin/sh\nexec "%s" -m pip "$@"\n' "$WORK/venv/bin/python" > "$WORK/venv/bin/pip"
chmod +x "$WORK/venv/bin/pip"
# shellcheck disable=SC1091
source "$WORK/venv/bin/activate"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true
HAS_VLLM=0
python -c 'import vllm' > /dev/null 2>&1 && HAS_VLLM=1
ONLINE=0
if [ "${QUICKSTART_OFFLINE:-0}" != 1 ] &&
    timeout 10 python -c 'import urllib.request; urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=8)' \
        > /dev/null 2>&1; then
    ONLINE=1
fi
say "vllm importable: $HAS_VLLM; PyPI reachable: $ONLINE; work folder $WORK"
rm -rf runs/gpu-native runs/gpu-vllm  # fresh runs (a finished run folder would be "already complete")

# ---------------------------------------------------------------- run each line
RESULTS=$WORK/results.jsonl
: > "$RESULTS"
record() {  # n, status (ok / failed / skipped / note), exit code, seconds, command, note
    python - "$@" >> "$RESULTS" <<'EOF'
import json, sys
n, status, rc, secs, cmd, note = sys.argv[1:7]
print(json.dumps({"line": int(n), "status": status, "exit_code": int(rc), "seconds": float(secs), "command": cmd, "note": note}))
EOF
}
SERVER_PID=""
n=0
for line in "${LINES[@]}"; do
    n=$((n + 1))
    cmd=$line
    note=""
    case "$cmd" in
    MODEL=*)
        # a tiny Qwen2 (4 heads of 64: vLLM's kernels) SFT'd on add2 by the demo's own SFT phase until it answers
        # 40% of dev prompts: a random model scores 0 on add2 in every group, and a run with no non-zero
        # advantage stops as "nothing to learn" (exit 1, no final model) instead of training
        python -m relayrl.apps.demo --device cuda --hidden 256 --rl_steps 1 --eval_rows 16 \
            --output_dir "$WORK/demo" > "$OUT/$n.log" 2>&1
        MODEL=$WORK/demo/sft/model
        export MODEL
        record "$n" note 0 0 "$cmd" "MODEL=$MODEL (a tiny Qwen2 built and SFT'd on add2 here: relayrl demo's SFT phase)"
        continue
        ;;
    pip\ install*)
        if [ "$HAS_VLLM" = 0 ]; then
            cmd=${cmd//"'.[vllm]'"/.}
            note="vllm not installed: installs . instead of .[vllm]"
        fi
        if [ "$ONLINE" = 0 ]; then
            cmd="${cmd%%#*} --no-index --no-build-isolation${WHEELS:+ --find-links $ROOT/$WHEELS}"
            note="$note; offline: resolved against the installed packages"
        fi
        ;;
    *"--rollout.engine vllm"*)
        if [ "$HAS_VLLM" = 0 ]; then
            record "$n" skipped 0 0 "$cmd" "vllm is not importable here"
            say "skip (no vllm): $cmd"
            continue
        fi
        ;;
    esac
    say "run: $cmd"
    t0=$(date +%s.%N)
    if [[ "$cmd" == relayrl\ serve* ]]; then
        eval "${cmd%%&*}" > "$OUT/$n.log" 2>&1 &
        SERVER_PID=$!
        rc=0
    elif [[ "$cmd" == curl* ]] && [ -n "$SERVER_PID" ]; then
        timeout 200 bash -c "$cmd" > "$OUT/$n.log" 2>&1 & # its retries wait for the server, while it lives
        client=$!
        while kill -0 "$client" 2> /dev/null; do
            if ! kill -0 "$SERVER_PID" 2> /dev/null; then
                kill "$client" 2> /dev/null
                note="the server exited (see $((n - 1)).log)"
                break
            fi
            sleep 1
        done
        wait "$client"
        rc=$?
    else
        limit=200
        [[ "$cmd" == *"--rollout.engine vllm"* ]] && limit=320 # vLLM's start-up (compile, CUDA graphs)
        timeout "$limit" bash -c "$cmd" > "$OUT/$n.log" 2>&1
        rc=$?
    fi
    if [[ "$cmd" == curl* ]]; then
        cp "$OUT/$n.log" "$OUT/server_reply.json"
        python -c 'import json, sys; r = json.load(open(sys.argv[1])); assert r["choices"][0]["text"] is not None' \
            "$OUT/server_reply.json" 2> /dev/null || { [ "$rc" != 0 ] || rc=1; note="$note; not a completion reply"; }
    fi
    secs=$(python -c "import time; print(round(time.time() - $t0, 1))")
    status=ok
    [ "$rc" = 0 ] || status=failed
    if [[ "$cmd" == pip\ install* ]] && [ "$rc" != 0 ]; then
        # which part failed: do pyproject's ranges resolve against the installed packages (no build needed)?
        python - "$HAS_VLLM" > "$WORK/reqs.txt" <<'EOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + (project["optional-dependencies"]["vllm"] if sys.argv[1] == "1" else [])))
EOF
        if pip install --dry-run --no-index${WHEELS:+ --find-links $ROOT/$WHEELS} -r "$WORK/reqs.txt" \
            > "$OUT/$n.resolve.log" 2>&1; then
            note="$note; the dependency ranges resolve against the installed packages, the install itself failed"
        else
            note="$note; RESOLUTION FAILED against the installed packages ($n.resolve.log)"
        fi
        pip install -q --no-deps --no-index --no-build-isolation -e . >> "$OUT/$n.log" 2>&1 &&
            note="$note; installed with --no-deps to run the other lines"
    fi
    if [[ "$cmd" == pip\ install* ]] && ! command -v relayrl > /dev/null; then
        printf '#!/bin/sh\nexec python -m relayrl.cli "$@"\n' > "$WORK/venv/bin/relayrl" # not installed: the checkout
        chmod +x "$WORK/venv/bin/relayrl"
        export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
        note="$note; relayrl not installed: runs from the checkout"
    fi
    record "$n" "$status" "$rc" "$secs" "$cmd" "$note"
    say "$status (exit $rc, ${secs} s)"
done
if [ -n "$SERVER_PID" ]; then
    kill "$SERVER_PID" 2> /dev/null
    wait "$SERVER_PID" 2> /dev/null
fi

# ---------------------------------------------------------------- summary
for run in gpu-native gpu-vllm; do
    [ -f "runs/$run/metrics.jsonl" ] && cp "runs/$run/metrics.jsonl" "$OUT/$run.metrics.jsonl"
done
python - "$RESULTS" "$OUT" <<'EOF'
import importlib.metadata as md, json, sys
from pathlib import Path
results = [json.loads(l) for l in Path(sys.argv[1]).read_text().splitlines()]
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
out = Path(sys.argv[2])
reply = out / "server_reply.json"
summary = {
    "lines": results,
    "all_ok": all(r["status"] in ("ok", "note", "skipped") for r in results),
    "versions": {p: version(p) for p in ("relayrl", "torch", "transformers", "vllm", "ray", "numpy")},
    "gpu": (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").exists() else None,
    "server_reply": reply.read_text()[:2000] if reply.exists() else None,
}
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps({k: summary[k] for k in ("all_ok", "versions")}))
for r in results:
    print(f"{r['line']:>2} {r['status']:<7} {r['seconds']:>6.1f} s  {r['command'][:100]}  {r['note']}")
EOF
rm -rf "$WORK"
