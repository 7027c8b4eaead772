#!/usr/bin/env bash
# The peer cells on a lent GPU machine that returns at most 8 files a call, stops a command at 10 minutes and
# is given back after 30 s without a call: the cells run as ONE background job (setsid) that later calls read.
# Here (a machine with network), once:
#   bash /work/shared/tools/wheel-parts.sh W/ray 'ray==2.60.0' jsonschema referencing rpds-py jsonschema-specifications
#   bash /work/shared/tools/vllm-bundle.sh W/vllm          # part0..part3
#   bash bench/peers/build_wheels.sh W/peers               # verl/, openrlhf/
# then copy each part into its own ignored top-level folder (raypart0, raypart1, vllmpart0..3, peers_wheels).
# There, in back-to-back calls (each carrying its folders; the next call within 30 s of the last):
#   bash bench/peers/remote.sh stage raypart0 ray0 && bash bench/peers/remote.sh peers peers_wheels
#   bash bench/peers/remote.sh stage raypart1 ray1 && bash bench/peers/remote.sh stage vllmpart3 v3
#   bash bench/peers/remote.sh stage vllmpart0 v0   ...   v1, v2; in the last of them also:
#   bash bench/peers/remote.sh start <commit> "A=--cells verl:7b:1,openrlhf:7b:1 --budget 620;B=--cells ..."
#   bash bench/peers/remote.sh poll 540     (again and again, back to back, until it prints "pipeline done")
# A stage "NAME=trl <trl_grpo.py args>" runs bench/peers/trl_grpo.py on GPU 0 instead (TRL's wheels, as in
# bench/peers/README.md, in peers_wheels/trl/; its results file is copied into the stage's folder).
# Each poll packs everything written so far into $OUT/res.tgz (one file). Staging dirs: /root/wstage;
# results: /root/res/<stage name>/ (run_cells' files + driver.txt) and /root/res/pipeline.log.
set -uo pipefail
cmd=${1:?usage: remote.sh stage|peers|start|poll ...}; shift
R=/root/res
case $cmd in
  stage)  # SRC NAME: a carried folder's parts -> /root/wstage/NAME
    mkdir -p /root/wstage/"$2" && cp "$1"/* /root/wstage/"$2"/ && echo "staged $2: $(ls /root/wstage/"$2")" ;;
  peers)  # WHEELS: keep the peers' wheel folders for setup_gpu.sh
    rm -rf /root/peers_wheels && cp -a "$1" /root/peers_wheels && echo "peers' wheels kept" ;;
  start)  # COMMIT "NAME=run_cells args;NAME=..."
    rm -rf $R /root/repo && mkdir -p $R /root/repo && \
      cp -a relayrl bench tests examples pyproject.toml README.md /root/repo/ || { echo "copy failed"; exit 1; }
    (cd /root/repo && RELAYRL_COMMIT="$1" setsid nohup bash bench/peers/remote.sh pipeline "$2" \
       > /dev/null 2>&1 < /dev/null &)
    echo "pipeline started: $2" ;;
  pipeline)  # (under setsid, from start) unpack Ray and vLLM, check the imports, run each stage in turn
    exec > $R/pipeline.log 2>&1
    echo $$ > $R/pipeline.pid
    t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
    cat /root/wstage/ray0/* /root/wstage/ray1/* > /root/w.tar && tar xf /root/w.tar -C /root/wstage && \
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/wstage/whl/*.whl
    el "ray rc=$?"
    cat /root/wstage/v0/* /root/wstage/v1/* /root/wstage/v2/* /root/wstage/v3/* > /root/site.tar.xz && \
      python3 -c "import tarfile; tarfile.open('/root/site.tar.xz').extractall('/root/vsite')"
    el "vllm rc=$?"
    export PYTHONPATH=/tmp/peers:/tmp/site:/root/vsite:/root/repo
    bash bench/peers/setup_gpu.sh /root/peers_wheels /tmp/peers > $R/setup.txt 2>&1; el "setup rc=$?"
    if ls /root/peers_wheels/trl/*.whl > /dev/null 2>&1; then  # TRL's stages: trl, datasets, dill, ...
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/peers \
        /root/peers_wheels/trl/*.whl >> $R/setup.txt 2>&1; el "trl wheels rc=$?"
    fi
    IFS=';' read -ra stages <<< "$1"
    for st in "${stages[@]}"; do
      name=${st%%=*}; mkdir -p $R/"$name"; el "start $name: ${st#*=}"
      args=${st#*=}
      if [ "${args%% *}" = trl ]; then  # "trl <trl_grpo.py args>": relayrl, then TRL, on GPU 0
        # shellcheck disable=SC2086  # the stage's arguments split on spaces
        CUDA_VISIBLE_DEVICES=0 timeout -k 20 900 python3 bench/peers/trl_grpo.py ${args#trl } \
          > $R/"$name"/driver.txt 2>&1
        rc=$?; cp bench/results/peers_trl_grpo.json $R/"$name"/ 2>/dev/null
      else
        # shellcheck disable=SC2086
        OUT=$R/$name timeout -k 20 1500 python3 bench/peers/run_cells.py $args > $R/"$name"/driver.txt 2>&1
        rc=$?
      fi
      el "done $name rc=$rc"
    done
    el "pipeline done"; touch $R/pipeline.done ;;
  poll)  # SECONDS: wait for the end (or SECONDS), pack the results into $OUT/res.tgz, print the tables
    end=$(( $(date +%s) + $1 ))
    alive() { [ -f $R/pipeline.pid ] && kill -0 "$(cat $R/pipeline.pid)" 2>/dev/null; }
    while [ ! -f $R/pipeline.done ] && alive && [ "$(date +%s)" -lt $end ]; do sleep 5; done
    tar czf "$OUT"/res.tgz -C /root res 2>/dev/null
    tail -12 $R/pipeline.log; for f in $R/*/cells.md; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
    for f in $R/*/peers_trl_grpo.json; do [ -f "$f" ] && { echo "== $f"; tail -8 "$(dirname "$f")/driver.txt"; }; done
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
    if [ -f $R/pipeline.done ]; then echo "pipeline done"
    elif ! alive; then echo "pipeline NOT RUNNING (died or never started): see pipeline.log"
    else echo "pipeline still running"; fi ;;
  *) echo "remote.sh: unknown command $cmd" >&2; exit 2 ;;
esac
