#!/usr/bin/env bash
# One device call: GPU tests, kernel checks/timings, and the Whisper benchmark.
#   bash benchmarks/h200_run.sh tests|real|kernels|tiny|large|beam|tp|prefill|prefill-small|prompt-tests|prefill-tests|arrivals   (several allowed, in order;
#   tp needs a host with >= 2 GPUs)
#   beam-device (~6 min), serve-ab (~7 min: admission batching), serve (~9 min: audio pool in-process vs --engine-process), soak (10,000 requests at 256)
#   Mllama: mllama-tests (~1.5 min), mllama11b (~9 min), mllama-vision (~1.5 min),
#   mllama-kernels (~0.5 min), chat (~3 min); gpu-all: every test marked gpu (~5-9 min)
#   idle (~4 min: GPU-idle time by host frame), serve-now (~3 min: the default server at 1 and 32 clients),
#   serve-both (~7 min: the engine on a thread vs the default engine process, 1, 32, 64 clients),
#   serve-default (~3 min: the default server at 1, 32, 64 clients, py-spy of the API process)
#   w13-tests (~1 min), decode-kernels (~1.5 min), serve-mel (~4 min: long-form log-mels on the GPU vs the audio workers)
#   w14-profile (~5 min), w14-sample (~6 min), w14-serve (~7 min), w14-final (~8 min), w14-syncs (~2.5 min), w15-serve (~6 min), w16-ab (~7 min), w16-guess (~2 min), w16-long (~5 min), w16-slots (~6 min), w16-vision (~2 min)
#   w18-mix (~5 min: greedy rows beside one beam request), w19-mixkern (~3 min: its GPU busy and kernels), w19-beamgraph (~7 min)
#   w21-beam (~8 min: beam candidates by the Triton top-k vs torch.topk; decoder GEMMs at decode rows)
#   w21-final (~9 min: top-k launch shapes, beam A/B, real path flat and aligned, arrivals)
#   w21-verify (~7 min: GPU tests of the final tree, beam 5 on the transcription path, both top-k paths)
#   w23-mllama (~5 min: the 11B decode step synced and back to back), w23-beam-hf (~5 min: beam 5 vs HF's)
#   w28-final (~5 min: GPU tests of the wave, beam 5 flat/aligned and with EOS + timestamps)
#   w38 (~7 min: the TMA attention's GPU tests, kernel sweep, prefill sdpa vs tma), w38-b (~8 min: real path vs _ab/before, vision tower)
#   w38c / w38d (~4-6 min: GPU tests, kernel sweep, the 11B vision tower), w38-mllama (~8 min: issue 24's protocol, vision on tma vs triton)
#   w39 (~9 min: GPU tests of wave 38's last commits, the default server at 1/32/64 clients, arrivals)
#   w39-mllama (~5 min: Mllama GPU tests, 16 / 64 image requests vs HF with the shared KV-pool layers)
#   w39-pixels (~6 min: Mllama pixel upload by stack_pixels vs the host cat, 64 image requests this tree vs _ab/before)
#   w40-fa3 (~7 min: FlashAttention-3 (build/fa3, tools/build_fa3.sh, carried): its GPU tests, the kernel against
#     cuDNN and the TMA kernel, the large-v3 prefill with it, the 11B vision tower with it)
#   w40-serve (~9 min: engine GPU tests with fa3 as auto, the server at 32 clients sdpa / fa3 twice), w40-mllama (~9 min:
#     Mllama GPU tests, issue 24's protocol with the vision tower on fa3 vs tma), w40-arrivals (~6 min: the engine
#     under arrivals, sdpa / fa3 twice), w40-final (~7 min: the wave's GPU tests, issue 24's protocol on fa3)
#   w38-attn (~2 min: the encoder's attention through TMA descriptors vs cuDNN, swept)
#   w37 (~9 min; _ab/before0 = git archive ca68fb9 edserve, _ab/before = the tree before the worker's input
#     thread, carried: GPU tests of wave 37, then the server at 32 clients from before0 / before / this tree twice)
#   w36-capture (~5 min, after git revert 97631a6: GPU tests of the run-time graph captures, then the default server at 32 clients twice (fresh, then warm), py-spy of the engine; py-spy's wheel in .whl/)
#   w35-chat-load (~6 min: chat at 32 clients on the small random Mllama, text vs JSON mode)
#   w35-chat (~3 min: grammar rows in CUDA-graph batches, their step cost at vocab 128256 with 1-64 rows; needs llguidance's wheel in .whl/)
#   w33-last (~2-3 min: the default server at 32 clients with its language guesses counted, then the wave's GPU tests)
#   w33-guess (~4 min: the wave's GPU tests, the default server at 32 clients, its language guesses counted; then with language=en given)
#   w33-graphs (~4 min: encoder graph tests; the default server at 32 clients vs --encoder-cuda-graph-max-bs 16, py-spy of the engine)
#   w32-serve (~5 min: the default server at 1 and 32 clients, CPU by role: the engine process's stepping thread busy share, py-spy of it at 32)
#   w30-final (~7 min: GPU tests of the graph runners' step(), then serve-full), w30-real (~5 min: the real path, with HF then twice without)
#   w29-final (~6 min: the real path with HF on the final tree, then after / before0 twice)
#   w29-stats (~8 min: greedy batches through the one-read logits kernel: GPU tests, real path after / before (_ab/before) / before0 (_ab/before0))
#   w29-ts (~8 min: the timestamp-rules kernel's GPU tests, the real path A/B against _ab/before, large-v3 64 and tiny.en 256)
#   w28-stats (~8 min: the fused logits kernel's GPU tests and sweep, beam 5 A/B against _ab/before, the timeline)
#   w27-copy (~6 min: the pair copy's early exit, beam A/B against _ab/before), w27-verify (~8 min: the batched admission / release, timeline + beam 5 + the real path)
#   w26-choice (~8 min: the Triton beam choice tested, alone, and in the engine vs the tensor ops), w26-ab (~8 min),
#   w26-self (~4 min), w26-tail (~6 min), w26-paged (~7 min), w26-final (~2 min: GPU tests of the wave's changes)
#   w25-host (~3 min: cProfile of beam and greedy steps), w25-ab (~10 min), w25-prefill (~4 min), w25-logits (~3 min), w25-vocab (~6 min)
#   w24-attn (~9 min: the Triton vision attention swept, tested, and against HF at 64 image requests), w24-mllama (~8 min), w24-variants (~3 min), w24-strategies (~6 min)
#   w17-attn (~1 min: SDPA backends at native vs zero-padded head dims), w17-ab (~7 min: audio jobs from the event loop vs the process pool), w17-long (~4 min), w17-soak (~3 min)
#   w12-tests, quant-sweep, cross-decode (~1 min each), prefill-fp8 (~3 min), serve-http (~6 min: httptools vs h11), serve-fp8 (~4 min), serve-full (~5 min)
set -uo pipefail
# PyAV is not on the GPU image: carry its wheel in .whl/ (see benchmarks/RESULTS.md)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
FA3_LIB=$PWD/build/fa3/libedserve_fa3.so  # tools/build_fa3.sh, carried (the w40 modes)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# realpath_ab NAME LIMIT "TREE ARCH CONC"...: whisper_realpath.py (flat/128, overlap on, no HF)
# once per run, TREE "after" = this tree, else _ab/TREE (an untracked copy of another tree's
# edserve/); prints each run's table row, logs to $OUT/NAME_TREE.log
realpath_ab() {
  local name=$1 limit=$2 pp; shift 2
  for run in "$@"; do
    set -- $run
    pp=$PWD:/tmp/site; [ "$1" != after ] && pp=$PWD/_ab/$1:/tmp/site
    echo "--- $run"
    (cd benchmarks && PYTHONPATH=$pp timeout "$limit" python3 -W ignore whisper_realpath.py --arch "$2" \
      --concurrency "$3" --config flat:128 --overlap on --no-hf 2>&1 | grep -v "custom logits" \
      | tee -a "$OUT/${name}_$1.log" | tail -1)
  done
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for part in "$@"; do
  echo "=== $part $(date -u +%H:%M:%S)"
  case $part in
    tests) timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_gpu_syncs.py tests/engine/test_gpu.py \
             tests/engine/test_triton_engine.py tests/kernels/test_write_req_to_token.py tests/kernels/test_kv_copy.py \
             -rs 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    real) for spec in "large-v3 64 flat:128 on" "large-v3 64 flat:128 off" "large-v3 64 aligned:128 on" "tiny.en 256 flat:128 on" "tiny.en 256 flat:128 off"; do
            set -- $spec
            (cd benchmarks && timeout 200 python3 -W ignore whisper_realpath.py --arch $1 --concurrency $2 --config $3 --overlap $4 2>&1 \
               | grep -v "custom logits" | tee -a "$OUT/real.log" | tail -3)
          done ;;
    kernels) python3 benchmarks/gpu_kernels.py --dtypes bfloat16 --budget-s 100 2>&1 | tee "$OUT/kernels.log" | tail -60 ;;
    tiny) python3 benchmarks/whisper_gpu.py --arch tiny.en --split --json "$OUT/bench.jsonl" 2>&1 | tee "$OUT/tiny.log" ;;
    large) timeout 330 python3 benchmarks/whisper_gpu.py --arch large-v3 --concurrency 1 16 64 --split --configs flat:1:graph flat:128:graph aligned:128:graph ragged:1:eager --json "$OUT/bench.jsonl" 2>&1 | tee "$OUT/large.log" ;;
    beam) timeout 100 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu_beam.py -rs 2>&1 \
            | grep -v "Loading weights" | tee "$OUT/beam_tests.log" | tail -30
          (cd benchmarks && timeout 270 python3 -W ignore beam_gpu.py --concurrency 16 64 --configs flat:128 2>&1 \
             | grep -v "custom logits" | tee "$OUT/beam_gpu.log")
          (cd benchmarks && timeout 150 python3 -W ignore beam_gpu.py --concurrency 16 64 --configs aligned:128 --no-hf 2>&1 \
             | grep -v "custom logits" | tee -a "$OUT/beam_gpu.log") ;;
    tp) timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/parallel/test_tp_gpu.py -rs 2>&1 \
          | tee "$OUT/tp_tests.log" | tail -15   # needs >= 2 GPUs (nvidia-h200-x2)
        timeout 540 python3 benchmarks/tp_gpu.py 2>&1 | tee "$OUT/tp_gpu.log" ;;
    prefill-tests) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_prefill_syncs.py tests/models/test_fp8.py \
               tests/models/test_whisper_encoder.py tests/models/test_encoder_graphs.py tests/kernels/test_kv_write.py \
               tests/engine/test_cross_kv_writes.py -k "not keeps_tiny_en" -rs 2>&1 | tee "$OUT/prefill_tests.log" | tail -15 ;;
    # every prefill path (before / contiguous / eager / compiled / graphs / fp8 / fp8-compiled) in one run, ~4 min
    prefill) timeout 480 python3 benchmarks/prefill_gpu.py --arch large-v3 --batch 2 16 32 2>&1 | tee "$OUT/prefill.log" ;;
    # small-batch prefill: per-clip cost at batch 1-2 and a host + device profile of one batch-1 step
    prompt-tests) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_prompt_graphs.py \
             tests/engine/test_prefill_syncs.py tests/engine/test_gpu_syncs.py tests/models/test_encoder_graphs.py -rs 2>&1 | tee "$OUT/prompt_tests.log" | tail -15 ;;
    prefill-small) timeout 240 python3 benchmarks/prefill_gpu.py --arch large-v3 --batch 1 2 16 --variants prompt-eager eager graphs \
             --profile-batch 1 --repeats 5 --rows 25 2>&1 | tee "$OUT/prefill_small.log" | grep -v "^ *[0-9]* *0.000" | head -150 ;;
    arrivals) timeout 500 python3 benchmarks/arrivals_gpu.py --arch large-v3 --budgets 24576 262144 2>&1 | tee "$OUT/arrivals.log" ;;
    large256) python3 benchmarks/whisper_gpu.py --arch large-v3 --concurrency 256 --configs flat:1:graph aligned:128:graph ragged:1:eager --json "$OUT/bench.jsonl" 2>&1 | tee "$OUT/large256.log" ;;
    beam-device) timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_beam_rows.py \
             tests/engine/test_beam_device.py tests/mem_cache/test_reorder.py tests/engine/test_gpu_beam.py \
             tests/kernels/test_kv_copy.py -rs 2>&1 \
             | tee "$OUT/beam_device_tests.log" | tail -15
           for dev in "" "--beam-on-device"; do
             (cd benchmarks && timeout 150 python3 -W ignore beam_gpu.py --concurrency 64 --configs flat:128 aligned:128 \
                --beam 5 --no-hf --profile 12 $dev 2>&1 | grep -v "custom logits" | tee -a "$OUT/beam_device.log" | tail -12)
           done ;;
    serve) (cd benchmarks && timeout 560 python3 -W ignore serve_gpu.py --json "$OUT/serve_gpu.json" --serve-flags= --serve-flags=--engine-process 2>&1 \
             | tee "$OUT/serve_gpu.log" | grep -v "^#   ") ;;
    # admission batching A/B: short clips only, three servers (~7 min)
    serve-ab) (cd benchmarks && timeout 560 python3 -W ignore serve_gpu.py --concurrency 1 32 64 --longform 0 \
             --json "$OUT/serve_ab.json" --serve-flags= --serve-flags='--admission-wait-ms 15' \
             --serve-flags='--admission-wait-ms 40' 2>&1 | tee "$OUT/serve_ab.log" | grep -v "^#   [a-z_]* .*(n=") ;;
    # in-process vs --engine-process, short clips only, with the engine's step/idle totals (~5 min)
    serve-proc) (cd benchmarks && timeout 400 python3 -W ignore serve_gpu.py --concurrency 32 64 --longform 0 \
             --json "$OUT/serve_proc.json" --serve-flags= --serve-flags=--engine-process 2>&1 \
             | tee "$OUT/serve_proc.log" | grep -v "^#   [a-z_]* .*(n=") ;;
    # chat under load at the real 11B size (random weights saved once, ~21 GB)
    chat11b) timeout 200 python3 benchmarks/chat_load.py --save-random /tmp/mllama_11b --size 11b 2>&1 | tail -2
          PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 python3 -W ignore benchmarks/chat_load.py --serve /tmp/mllama_11b \
             --clients 32 --requests 256 --max-tokens 64 --json "$OUT/chat_load_11b.json" 2>&1 | tee "$OUT/chat_load_11b.log" | tail -5 ;;
    soak) (cd benchmarks && timeout 400 python3 -W ignore soak_gpu.py --requests 10000 --concurrency 256 \
             --json "$OUT/soak_gpu.json" 2>&1 | tee "$OUT/soak_gpu.log" | tail -30) ;;
    mllama-tests) timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/models/mllama/test_gpu_graph.py \
             tests/models/mllama/test_vision_plan.py tests/kernels/test_norm_act.py tests/kernels/test_rope.py \
             -rs 2>&1 | tee "$OUT/mllama_tests.log" | tail -15 ;;
    mllama11b) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 570 python3 -W ignore benchmarks/mllama_gpu.py \
             --size 11b --profile --json "$OUT/mllama_11b.json" 2>&1 \
             | tee "$OUT/mllama_11b.log" ;;
    # wave 23: the 11B decode step synced and back to back, with its kernel table (~5 min)
    w23-mllama) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 560 python3 -W ignore benchmarks/mllama_gpu.py \
             --size 11b --batches 16,64 --strategies aligned:128 --profile --decode-steps 10 \
             --json "$OUT/mllama_11b.json" 2>&1 | tee "$OUT/mllama_11b.log" ;;
    # wave 23: batches 1 / 16 / 64 with and without mixed steps, the timed run's steps by kind (~5 min)
    w23-mllama-mix) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 560 python3 -W ignore benchmarks/mllama_gpu.py \
             --size 11b --batches 1,16,64 --strategies aligned:128,aligned:128:nomix --decode-steps 10 --repeats 3 \
             --json "$OUT/mllama_11b_mix.json" 2>&1 | tee "$OUT/mllama_11b_mix.log" ;;
    # wave 24: the Triton dense attention for the vision tower: tile sweep vs SDPA's backends,
    # GPU tests, the tower with the sweep's best, then 64 image requests vs HF with it and with SDPA (~9 min)
    w24-attn) timeout 150 python3 -W ignore benchmarks/attn_headdim.py 2>&1 | tee "$OUT/attn_headdim.log"
             best=$(grep "vision 4-tile, all .*BEST" "$OUT/attn_headdim.log" \
                    | sed -E 's/.*BEST triton ([0-9]+)x([0-9]+) w([0-9]+) s([0-9]+).*/\1,\2,\3,\4/')
             echo "best tiles: ${best:-default}"
             timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_dense_attention.py \
               tests/models/mllama/test_vision_plan.py tests/models/mllama/test_vision.py -rs 2>&1 \
               | tee "$OUT/w24_tests.log" | tail -8
             timeout 100 python3 -W ignore benchmarks/mllama_vision.py --size 11b --no-hf --shapes 4,mixed \
               --runs 3 ${best:+--dense-tiles $best} 2>&1 | tee "$OUT/mllama_vision.log"
             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 330 python3 -W ignore benchmarks/mllama_gpu.py \
               --size 11b --batches 64 --strategies aligned:128,aligned:128:sdpa --decode-steps 10 --repeats 2 \
               ${best:+--dense-tiles $best} --json "$OUT/mllama_11b_w24.json" 2>&1 | tee "$OUT/mllama_11b_w24.log" ;;
    # wave 25: host time by function (cProfile) of 30 beam steps (64 x beam 5) and 30 greedy steps at 64 rows (~3 min)
    w25-host) (cd benchmarks && timeout 300 python3 -W ignore gpu_idle.py --scenarios beam64 decode64 --cprofile 45 \
             2>&1 | grep -v "custom logits" | tee "$OUT/w25_host.log" | grep -E "^## |function calls") ;;
    # wave 25: host lists packed by array (and the beam step's row passes) vs the tree before
    # (_ab/before = git archive 42557c5 edserve; carried, imported first): beam 5 vs greedy at 64 (flat/128, forced 100
    # tokens), then the real path at 64, alternating after/before (~10 min)
    w25-ab) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_host_copy.py tests/engine/test_gpu_beam.py \
             tests/engine/test_gpu_sample_graphs.py tests/engine/test_gpu_syncs.py -rs 2>&1 | grep -v "Loading weights" \
             | tee "$OUT/w25_tests.log" | tail -3
           for tree in after before after2 before2; do
             pp=$PYTHONPATH; case $tree in before*) pp=$PWD/_ab/before:/tmp/site ;; esac
             echo "--- $tree"
             (cd benchmarks && PYTHONPATH=$pp timeout 200 python3 -W ignore beam_gpu.py --concurrency 64 --configs flat:128 \
               --beam 5 --beam-on-device --no-hf 2>&1 | grep -v "custom logits" | tee -a "$OUT/w25_beam_$tree.log" | grep -E "^flat")
           done
           for tree in after before after2 before2; do
             pp=$PYTHONPATH; case $tree in before*) pp=$PWD/_ab/before:/tmp/site ;; esac
             echo "--- $tree"
             (cd benchmarks && PYTHONPATH=$pp timeout 150 python3 -W ignore whisper_realpath.py --arch large-v3 --concurrency 64 \
               --config flat:128 --overlap on 2>&1 | grep -v "custom logits" | tee -a "$OUT/w25_real_$tree.log" | tail -2)
           done ;;
    # wave 27's batched beam admission / release, verified: GPU beam tests, the run's timeline, beam 5 on flat and aligned (~6 min)
    # wave 28: the sampler's fused logits read (argmax, logsumexp, top-k): GPU tests, shapes,
    # beam 5 vs greedy with and without it (_ab/before = the tree before, alternating), timeline
    w28-final) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_logit_stats.py \
             tests/kernels/test_row_topk.py tests/engine/test_gpu_beam.py tests/engine/test_gpu_sample_graphs.py \
             tests/engine/test_sample_graphs.py tests/engine/test_beam_device.py tests/engine/test_gpu_syncs.py \
             tests/engine/test_gpu.py -rs 2>&1 | grep -v "Loading weights" | tee "$OUT/w28_final_tests.log" | tail -3
           for cfg in "flat:128" "aligned:128" "flat:128 --eos-timestamps"; do
             (cd benchmarks && timeout 100 python3 -W ignore beam_gpu.py --concurrency 64 --configs $cfg --beam 5 \
               --beam-on-device --no-hf 2>&1 | grep -v "custom logits" | tee -a "$OUT/w28_final_beam.log" \
               | grep -E "^(flat|aligned)" | cut -c1-200 | sort -u)
           done ;;
    # wave 30: the GPU tests of the graph runners' step() and sampling graphs, then issue 18's protocol again (~7 min)
    w30-final) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/engine/test_gpu_syncs.py \
             tests/engine/test_gpu_sample_graphs.py tests/engine/test_gpu_beam.py tests/engine/test_gpu_prompt_graphs.py \
             -rs 2>&1 | tee "$OUT/w30_tests.log" | tail -8
           (cd benchmarks && timeout 300 python3 -W ignore serve_gpu.py --json "$OUT/serve_full.json" 2>&1 \
             | tee "$OUT/serve_full.log" | grep -v "^#   [a-z_]* .*(n=") ;;
    # wave 30: the real path's protocol run (with HF) on the final tree, then two no-HF runs (~5 min)
    w30-real) (cd benchmarks && timeout 150 python3 -W ignore whisper_realpath.py --arch large-v3 --concurrency 64 \
               --config flat:128 --overlap on 2>&1 | grep -v "custom logits" | tee "$OUT/w30_real.log" | tail -3)
           realpath_ab w30_real_nohf 100 "after large-v3 64" "after large-v3 64" ;;
    w29-final) (cd benchmarks && timeout 150 python3 -W ignore whisper_realpath.py --arch large-v3 --concurrency 64 \
               --config flat:128 --overlap on 2>&1 | grep -v "custom logits" | tee "$OUT/w29_final_real.log" | tail -3)
           realpath_ab w29_final_ab 100 "after large-v3 64" "before0 large-v3 64" "after large-v3 64" \
             "before0 large-v3 64" ;;
    w29-stats) timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_sample_graphs.py \
             tests/engine/test_gpu_sample_graphs.py tests/engine/test_gpu_syncs.py tests/kernels/test_logit_stats.py \
             -rs 2>&1 | grep -v "Loading weights" | tee "$OUT/w29_stats_tests.log" | tail -3
           realpath_ab w29_stats_real 100 "after large-v3 64" "before large-v3 64" "before0 large-v3 64" \
             "after large-v3 64" "before large-v3 64" "before0 large-v3 64" "after tiny.en 256" "before tiny.en 256" ;;
    w29-ts) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_timestamp_rules.py \
             tests/engine/test_sample_graphs.py tests/engine/test_gpu_sample_graphs.py tests/engine/test_gpu_syncs.py \
             tests/engine/test_gpu_beam.py -rs 2>&1 | grep -v "Loading weights" | tee "$OUT/w29_tests.log" | tail -3
           realpath_ab w29_real 110 "after large-v3 64" "before large-v3 64" "after large-v3 64" \
             "before large-v3 64" "after tiny.en 256" "before tiny.en 256" ;;
    w28-stats) timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_logit_stats.py \
             tests/kernels/test_row_topk.py tests/engine/test_gpu_beam.py tests/engine/test_gpu_sample_graphs.py \
             tests/engine/test_sample_graphs.py -rs 2>&1 | grep -v "Loading weights" | tee "$OUT/w28_tests.log" | tail -2
           (cd benchmarks && timeout 120 python3 row_topk_gpu.py 2>&1 | tee "$OUT/w28_topk.log" | tail -8)
           for run in "after flat:128" "before flat:128" "after aligned:128" "before aligned:128"; do
             set -- $run
             pp=$PWD:/tmp/site; [ "$1" = before ] && pp=$PWD/_ab/before:/tmp/site
             echo "--- $1 $2"
             (cd benchmarks && PYTHONPATH=$pp timeout 100 python3 -W ignore beam_gpu.py --concurrency 64 --configs $2 \
               --beam 5 --beam-on-device --no-hf 2>&1 | grep -v "custom logits" | tee -a "$OUT/w28_beam_$1.log" \
               | grep -E "^(flat|aligned)" | cut -c1-200 | sort -u)
           done
           (cd benchmarks && timeout 100 python3 -W ignore beam_timeline.py --config flat:128 --gaps 4 2>&1 \
             | grep -v "custom logits" | tee "$OUT/w28_timeline.log" | tail -8) ;;
    w27-verify) timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_beam.py tests/kernels/test_kv_copy.py \
             tests/engine/test_beam_device.py -rs 2>&1 | grep -v "Loading weights" | tee "$OUT/w27_verify_tests.log" | tail -2
           (cd benchmarks && timeout 100 python3 -W ignore beam_timeline.py --config flat:128 2>&1 | grep -v "custom logits" \
             | tee "$OUT/w27_verify_timeline.log" | tail -6)
           for cfg in flat:128 aligned:128; do
             (cd benchmarks && timeout 100 python3 -W ignore beam_gpu.py --concurrency 64 --configs $cfg --beam 5 \
               --beam-on-device --no-hf 2>&1 | grep -v "custom logits" | tee -a "$OUT/w27_verify_beam.log" \
               | grep -E "^(flat|aligned)" | cut -c1-330)
           done
           (cd benchmarks && timeout 120 python3 -W ignore whisper_realpath.py --arch large-v3 --concurrency 64 --config flat:128 \
             --overlap on 2>&1 | grep -v "custom logits" | tee "$OUT/w27_verify_real.log" | tail -3) ;;
    # wave 27: the pair copy's early exit: its GPU tests, beam 5 A/B against _ab/before (flat and aligned), aligned's kernels (~6 min)
    w27-copy) timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kv_copy.py tests/engine/test_beam_rows.py \
             -k "cuda or kernel" -rs 2>&1 | tail -1
           for run in "after flat:128" "before flat:128" "after aligned:128" "before aligned:128"; do
             set -- $run
             pp=$PYTHONPATH; [ "$1" = before ] && pp=$PWD/_ab/before:/tmp/site
             echo "--- $1 $2"
             (cd benchmarks && PYTHONPATH=$pp timeout 100 python3 -W ignore beam_gpu.py --concurrency 64 --configs $2 \
               --beam 5 --beam-on-device --no-hf 2>&1 | grep -v "custom logits" | tee -a "$OUT/w27_copy_$1.log" \
               | grep -E "^(flat|aligned)" | cut -c1-330)
           done
           (cd benchmarks && timeout 150 python3 -W ignore beam_gpu.py --concurrency 64 --configs aligned:128 --beam 5 \
             --beam-on-device --no-hf --profile 30 2>&1 | grep -v "custom logits" | tee "$OUT/w27_copy_kernels.log" | grep -c .) ;;
    # wave 26: the beam choice as one Triton launch: tests, the choice alone, engine A/B (~8 min)
    w26-choice) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_beam_choice.py tests/engine/test_beam_device.py \
             tests/engine/test_beam_run_graph.py tests/engine/test_gpu_beam.py -rs 2>&1 | grep -v "Loading weights" \
             | tee "$OUT/w26_tests.log" | tail -4
           timeout 90 python3 benchmarks/beam_choice_gpu.py --groups 16 64 161 2>&1 | tee "$OUT/w26_choice.log"
           for run in "triton flat:128" "ops flat:128" "triton aligned:128" "ops aligned:128"; do
             set -- $run
             echo "--- $1 $2"
             (cd benchmarks && timeout 120 python3 -W ignore beam_gpu.py --concurrency 64 --configs $2 --beam 5 \
               --beam-on-device --no-hf --beam-choice $1 2>&1 | grep -v "custom logits" | tee -a "$OUT/w26_beam_$1.log" | grep -E "^(flat|aligned)")
           done ;;
    # wave 26: more alternating A/B rounds (aligned/128 x 4, flat/128 x 2), the aligned beam step's kernels (~8 min)
    w26-ab) timeout 60 python3 -m pytest -q -p no:cacheprovider tests/engine/test_beam_device.py -rs 2>&1 | tail -2
           for run in "ops aligned:128" "triton aligned:128" "ops aligned:128" "triton aligned:128" "ops flat:128" "triton flat:128"; do
             set -- $run
             echo "--- $1 $2"
             (cd benchmarks && timeout 120 python3 -W ignore beam_gpu.py --concurrency 64 --configs $2 --beam 5 \
               --beam-on-device --no-hf --beam-choice $1 2>&1 | grep -v "custom logits" | tee -a "$OUT/w26_ab_$1.log" | grep -E "^(flat|aligned|# large)" | cut -c1-330)
           done
           (cd benchmarks && timeout 150 python3 -W ignore beam_gpu.py --concurrency 64 --configs aligned:128 --beam 5 \
             --beam-on-device --no-hf --profile 30 2>&1 | grep -v "custom logits" | tee "$OUT/w26_beam_kernels.log" | grep -c .) ;;
    # wave 26: decoder self-attention kernels at decode shapes; beam 5 on the transcription path, both choices (~4 min)
    w26-self) (cd benchmarks && timeout 90 python3 self_attn_decode_gpu.py --rows 64 320 2>&1 | tee "$OUT/w26_self_attn.log")
           for run in ops triton; do
             echo "--- $run"
             (cd benchmarks && timeout 120 python3 -W ignore beam_gpu.py --concurrency 64 --configs flat:128 --beam 5 \
               --beam-on-device --eos-timestamps --beam-choice $run 2>&1 | grep -v "custom logits" | tee -a "$OUT/w26_eos_$run.log" \
               | grep -E "^(flat|# large)" | cut -c1-330)
           done ;;
    # wave 26: beam rows copy K/V only past the tokens they share with their parent, A/B (~6 min)
    w26-tail) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_beam.py tests/engine/test_beam_rows.py -rs 2>&1 \
             | grep -v "Loading weights" | tee "$OUT/w26_tail_tests.log" | tail -2
           for run in "--copy-whole-tail flat:128" "- flat:128" "--copy-whole-tail flat:128" "- flat:128" "--copy-whole-tail aligned:128" "- aligned:128"; do
             set -- $run; flag=$1; [ "$flag" = "-" ] && flag=""
             echo "--- ${flag:-shared} $2"
             (cd benchmarks && timeout 100 python3 -W ignore beam_gpu.py --concurrency 64 --configs $2 --beam 5 \
               --beam-on-device --no-hf $flag 2>&1 | grep -v "custom logits" | tee -a "$OUT/w26_tail.log" | grep -E "^(flat|aligned|# large)" | cut -c1-330)
           done ;;
    # wave 26: the paged kernel's decode tiles (64-key blocks, 2 warps), A/B against _ab/before on aligned/128 (~7 min)
    w26-paged) timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention.py tests/engine/test_gpu.py -rs 2>&1 \
             | grep -v "Loading weights" | tee "$OUT/w26_paged_tests.log" | tail -2
           for tree in after before after2 before2; do
             pp=$PYTHONPATH; case $tree in before*) pp=$PWD/_ab/before:/tmp/site ;; esac
             echo "--- $tree"
             (cd benchmarks && PYTHONPATH=$pp timeout 100 python3 -W ignore beam_gpu.py --concurrency 64 --configs aligned:128 --beam 5 \
               --beam-on-device --no-hf 2>&1 | grep -v "custom logits" | tee -a "$OUT/w26_paged_$tree.log" | grep -E "^(aligned|# large)" | cut -c1-330)
           done ;;
    # wave 26: the final tree's GPU tests of what the wave touched (~2 min)
    w26-final) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_beam_choice.py tests/engine/test_beam_device.py \
             tests/engine/test_beam_run_graph.py tests/engine/test_gpu_beam.py tests/kernels/test_paged_attention.py \
             tests/runtime/test_build_imports.py -rs 2>&1 | grep -v "Loading weights" | tee "$OUT/w26_final_tests.log" | tail -3 ;;
    # wave 25: the real path's prefill (64 clips in one step): eager vs encoder graphs at 32 and 64 clips, op table (~4 min)
    w25-prefill) (cd benchmarks && timeout 400 python3 -W ignore prefill_gpu.py --arch large-v3 --batch 32 64 --profile-batch 64 \
             --variants tanh graphs --repeats 3 --rows 25 2>&1 | grep -v "custom logits" | tee "$OUT/w25_prefill.log" | grep -E "^#|^tanh|^graphs") ;;
    # wave 25: the logits GEMM at the multilingual vocabulary's unaligned width vs padded (~0.5 min),
    # then the host time by function after the host-list change (beam 64 x 5, one row) (~2 min)
    w25-logits) timeout 120 python3 -W ignore benchmarks/logits_gemm_gpu.py 2>&1 | tee "$OUT/w25_logits_gemm.log"
           (cd benchmarks && timeout 300 python3 -W ignore gpu_idle.py --scenarios beam64 decode1 --cprofile 30 \
             2>&1 | grep -v "custom logits" | tee "$OUT/w25_host_after.log" | grep -E "^## |function calls|torch.tensor|array") ;;
    # wave 25: the padded vocabulary buffer: the logits GEMM, GPU tests, the real path and beam 5
    # vs the tree with the vocabulary left unaligned (_ab/nologits: a copy of edserve/ with the
    # loader's align_vocabulary() call removed; carried) (~6 min)
    w25-vocab) timeout 60 python3 -W ignore benchmarks/logits_gemm_gpu.py 2>&1 | tee "$OUT/w25_logits_gemm3.log" | tail -4
           timeout 150 python3 -m pytest -q -p no:cacheprovider tests/models/test_vocab_projection.py tests/engine/test_gpu.py \
             -k "vocab or large" -rs 2>&1 | grep -v "Loading weights" | tee "$OUT/w25_vocab_tests.log" | tail -3
           for tree in padded nologits; do
             pp=$PYTHONPATH; case $tree in nologits*) pp=$PWD/_ab/nologits:/tmp/site ;; esac
             echo "--- $tree"
             (cd benchmarks && PYTHONPATH=$pp timeout 150 python3 -W ignore whisper_realpath.py --arch large-v3 --concurrency 64 \
               --config flat:128 --overlap on 2>&1 | grep -v "custom logits" | tee -a "$OUT/w25_vreal_$tree.log" | tail -1)
           done
           for tree in padded nologits; do
             pp=$PYTHONPATH; case $tree in nologits*) pp=$PWD/_ab/nologits:/tmp/site ;; esac
             echo "--- $tree"
             (cd benchmarks && PYTHONPATH=$pp timeout 200 python3 -W ignore beam_gpu.py --concurrency 64 --configs flat:128 \
               --beam 5 --beam-on-device --no-hf 2>&1 | grep -v "custom logits" | tee -a "$OUT/w25_vbeam_$tree.log" | grep -E "^flat" | head -2)
           done ;;
    # wave 24: the vision/Mllama GPU tests, then 16 and 64 image requests vs HF, medians of 3 (~8 min)
    w24-mllama) timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_dense_attention.py \
               tests/models/mllama/test_vision_plan.py tests/models/mllama/test_vision.py \
               tests/models/mllama/test_gpu_graph.py -rs 2>&1 | tee "$OUT/w24_tests.log" | tail -8
             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 420 python3 -W ignore benchmarks/mllama_gpu.py \
               --size 11b --batches 16,64 --strategies aligned:128 --decode-steps 10 --repeats 3 \
               --json "$OUT/mllama_11b_w24.json" 2>&1 | tee "$OUT/mllama_11b_w24.log" ;;
    # wave 24: head dim 80 as 64 + 16 vs zero-padded 128, per dot, at the engine's group size (~3 min)
    w24-variants) timeout 420 python3 -W ignore benchmarks/dense_attn_variants.py 2>&1 | tee "$OUT/dense_attn_variants.log" ;;
    # wave 24: the three strategies at 1 and 16 image requests with the Triton vision attention (~6 min)
    w24-strategies) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 480 python3 -W ignore benchmarks/mllama_gpu.py \
               --size 11b --batches 1,16 --strategies flat:1,aligned:128,ragged:1 --decode-steps 10 --repeats 2 \
               --json "$OUT/mllama_11b_w24_strategies.json" 2>&1 | tee "$OUT/mllama_11b_w24_strategies.log" ;;
    # wave 24: 64 image requests vs HF with each system's run started from an emptied cache, allocator retries counted (~3 min)
    w24-hfmem) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 python3 -W ignore benchmarks/mllama_gpu.py \
               --size 11b --batches 64 --strategies aligned:128 --decode-steps 10 --repeats 3 \
               --json "$OUT/mllama_11b_w24_hfmem.json" 2>&1 | tee "$OUT/mllama_11b_w24_hfmem.log" ;;
    # wave 23: beam 5 against HF generate(num_beams=5) in the same run (~5 min)
    w23-beam-hf) (cd benchmarks && timeout 560 python3 -W ignore beam_gpu.py --concurrency 64 --configs flat:128 \
             --beam 5 --beam-on-device --repeats 2 2>&1 | grep -v "custom logits" | tee "$OUT/beam_hf.log") ;;
    mllama-kernels) timeout 120 python3 -W ignore benchmarks/mllama_kernels.py 2>&1 \
             | tee "$OUT/mllama_kernels.log" ;;
    # wave 7: fused add + LayerNorm (issue 19/24) and the beam-choice graph (issue 22)
    addnorm-tests) timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_add_norm.py \
             tests/models/test_whisper_encoder.py tests/models/test_encoder_graphs.py tests/models/mllama/test_vision.py \
             tests/engine/test_beam_device.py tests/engine/test_beam_rows.py tests/engine/test_gpu_beam.py -rs 2>&1 \
             | tee "$OUT/addnorm_tests.log" | tail -15 ;;
    addnorm) timeout 120 python3 benchmarks/add_norm_gpu.py --sweep 2>&1 | tee "$OUT/add_norm.log" | tail -40
             timeout 300 python3 benchmarks/prefill_gpu.py --arch large-v3 --batch 16 32 --variants eager unfused \
               --repeats 5 2>&1 | tee "$OUT/prefill_addnorm.log" | grep -v "^ *[0-9]* *0.000" | head -80 ;;
    gpu-all) timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu -rs $(grep -rl "mark.gpu" tests | sort) 2>&1 \
             | grep -v "Loading weights" | tee "$OUT/gpu_all.log" | tail -30 ;;
    beam-graph) (cd benchmarks && timeout 280 python3 -W ignore beam_gpu.py --concurrency 64 --configs flat:128 aligned:128 \
                --beam 5 --no-hf --profile 12 --beam-on-device 2>&1 | grep -v "custom logits" | tee "$OUT/beam_graph.log" | tail -40) ;;
    beam-eos) (cd benchmarks && timeout 200 python3 -W ignore beam_gpu.py --concurrency 64 --configs flat:128 --beam 5 \
                --beam-on-device --eos-timestamps 2>&1 | grep -v "custom logits" | tee "$OUT/beam_eos.log" | tail -8) ;;
    mllama-vision) timeout 240 python3 -W ignore benchmarks/mllama_vision.py --size 11b 2>&1 \
             | tee "$OUT/mllama_vision.log" ;;
    chat) timeout 120 python3 benchmarks/chat_load.py --save-random /tmp/mllama_small --size small 2>&1 | tail -2
          timeout 240 python3 -W ignore benchmarks/chat_load.py --serve /tmp/mllama_small --clients 32 --requests 256 \
             --max-tokens 64 --json "$OUT/chat_load.json" 2>&1 | tee "$OUT/chat_load.log" | tail -5 ;;
    # wave 10: GPU-idle time by the engine thread's frame (arrivals, a 16-clip prefill, 64-row decode)
    idle) (cd benchmarks && timeout 360 python3 -W ignore gpu_idle.py 2>&1 | grep -v "custom logits" \
             | tee "$OUT/gpu_idle.log") ;;
    # the default server at 1 and 32 clients, short clips only (~3 min)
    serve-now) (cd benchmarks && timeout 300 python3 -W ignore serve_gpu.py --concurrency 1 32 --longform 0 \
             --json "$OUT/serve_now.json" 2>&1 | tee "$OUT/serve_now.log" | grep -v "^#   [a-z_]* .*(n=") ;;
    serve-both) (cd benchmarks && timeout 480 python3 -W ignore serve_gpu.py --concurrency 1 32 64 --longform 0 --py-spy 4 \
             --json "$OUT/serve_both.json" --serve-flags=--no-engine-process --serve-flags= 2>&1 \
             | tee "$OUT/serve_both.log" | grep -v "^#   [a-z_]* .*(n=") ;;
    serve-default) (cd benchmarks && timeout 400 python3 -W ignore serve_gpu.py --concurrency 1 32 64 --longform 0 --py-spy 4 --py-spy-at 32 \
             --json "$OUT/serve_default.json" 2>&1 | tee "$OUT/serve_default.log" | grep -v "^#   [a-z_]* .*(n=") ;;
    idle-serve) (cd benchmarks && timeout 300 python3 -W ignore gpu_idle.py --scenarios serve arrivals 2>&1 \
             | grep -v "custom logits" | tee "$OUT/gpu_idle_serve.log") ;;
    w10-tests) timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_mel_staging.py \
             tests/engine/test_prefill_syncs.py tests/models/test_encoder_graphs.py -rs 2>&1 \
             | tee "$OUT/w10_tests.log" | tail -8 ;;
    host-copy) timeout 120 python3 benchmarks/host_copy_micro.py 2>&1 | tee "$OUT/host_copy.log" ;;
    prefill-w10) timeout 300 python3 benchmarks/prefill_gpu.py --arch large-v3 --batch 16 32 --variants tanh \
             --repeats 9 2>&1 | tee "$OUT/prefill_w10.log" | grep -A4 "^# batch" ;;
    arrivals-mixed) timeout 300 python3 benchmarks/arrivals_gpu.py --arch large-v3 --budgets 24576 2>&1 \
             | tee "$OUT/arrivals_mixed.log" ;;
    # wave 12: the fp8 encoder's one-pass activation scaling, the HTTP parser
    w12-tests) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_quant.py \
             tests/models/test_fp8.py tests/kernels/test_grouped_cross_attention.py -k "not keeps_tiny_en" -rs -s 2>&1 | tee "$OUT/w12_tests.log" | tail -8 ;;
    quant-sweep) timeout 120 python3 benchmarks/fp8_quant_gpu.py 2>&1 | tee "$OUT/fp8_quant.log" ;;
    cross-decode) timeout 120 python3 benchmarks/cross_decode_gpu.py 2>&1 | tee "$OUT/cross_decode.log" ;;
    prefill-fp8) timeout 300 python3 benchmarks/prefill_gpu.py --arch large-v3 --batch 16 32 --variants tanh fp8 \
             --repeats 5 2>&1 | tee "$OUT/prefill_fp8.log" | grep -v "^ *[0-9]* *0.000" | head -120 ;;
    # httptools (the default now) vs h11, short clips (~6 min)
    serve-http) (cd benchmarks && timeout 480 python3 -W ignore serve_gpu.py --concurrency 32 64 --longform 0 \
             --json "$OUT/serve_http.json" --serve-flags= --serve-flags='--http h11' 2>&1 \
             | tee "$OUT/serve_http.log" | grep -v "^#   [a-z_]* .*(n=") ;;
    # the server and the engine figure with --encoder-dtype fp8 --kv-cache-dtype fp8 (~4 min)
    serve-fp8) (cd benchmarks && timeout 400 python3 -W ignore serve_gpu.py --fp8 --concurrency 1 32 64 128 --longform 0 \
             --json "$OUT/serve_fp8.json" 2>&1 | tee "$OUT/serve_fp8.log" | grep -v "^#   [a-z_]* .*(n=") ;;
    # fp8 with the encoder in CUDA graphs up to 16 clips (the host's launches at small prefill batches) (~4 min)
    serve-fp8g) (cd benchmarks && timeout 400 python3 -W ignore serve_gpu.py --fp8 --concurrency 1 32 64 --longform 0 \
             --serve-flags='--encoder-cuda-graph-max-bs 16' --json "$OUT/serve_fp8g.json" 2>&1 | tee "$OUT/serve_fp8g.log" \
             | grep -v "^#   [a-z_]* .*(n=") ;;
    # issue 18's whole protocol on the default server: 1, 32, 64, 128 clients and 16 x 10-minute files (~5 min)
    w33-graphs) timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_encoder_graphs.py \
             "tests/models/mllama/test_gpu_graph.py::test_top_logprobs_in_sampling_graphs_equal_eager" 2>&1 \
             | tee "$OUT/w33_tests.log" | tail -2
             (cd benchmarks && timeout 420 python3 -W ignore serve_gpu.py --concurrency 32 --longform 0 --py-spy 4 \
             --py-spy-at 32 --py-spy-target engine --serve-flags= --serve-flags='--encoder-cuda-graph-max-bs 16' \
             --json "$OUT/w33_graphs.json" 2>&1 | tee "$OUT/w33_graphs.log" | grep -v "^#   [a-z_]* .*(n=") ;;
    # wave 34: the step log-mels' GPU test, then at 1 and 32 clients the default server, --step-features, and
    # both with a 4-clip prefill budget (mixed steps that fit the encoder graphs) (~8 min)
    w34-step) timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_step_mel.py 2>&1 \
             | tee "$OUT/w34_tests.log" | tail -2
             (cd benchmarks && timeout 480 python3 -W ignore serve_gpu.py --concurrency 1 32 --requests 192 --longform 0 \
             --serve-flags= --serve-flags=--step-features --serve-flags='--step-features --max-prefill-tokens 6144' \
             --serve-flags='--max-prefill-tokens 6144' --json "$OUT/w34_step.json" 2>&1 \
             | tee "$OUT/w34_step.log" | grep -v "^Writing" | grep -v "^#   [a-z_]* .*(n=") ;;
    # wave 34's new defaults (step log-mels, four windows per mixed step): 32 clients + 16 long files, the real
    # path at 64 (no HF), arrivals at the default budget, after the two GPU tests of wave 34 (~5 min)
    # wave 38: the TMA attention verified and measured: GPU tests (engine with it as the encoder's default),
    # the kernel at the Whisper and vision shapes, the prefill with sdpa vs tma (~7 min)
    w38) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_tma_attention.py \
             tests/layers/test_encoder_attention.py tests/models/test_encoder_graphs.py tests/engine/test_gpu.py 2>&1 \
             | tee "$OUT/w38_tests.log" | tail -3
           timeout 200 python3 -W ignore benchmarks/attn_tma_gpu.py 2>&1 | tee "$OUT/w38_attn_tma.log" | grep -E "cudnn|BEST|dense|w8 s3"
           timeout 240 python3 -W ignore benchmarks/prefill_gpu.py --arch large-v3 --batch 16 32 --variants tanh tma \
             --repeats 5 2>&1 | tee "$OUT/w38_prefill.log" | grep -E "^(# batch|tanh|tma|## profile|# one prefill|aten::_cudnn|aten::addmm|_tma_attn)" ;;
    # wave 38, after the last-block fix: GPU tests (TMA kernel, encoder attention, vision plan, engine), the kernel
    # at the Whisper and vision shapes, the 11B vision tower with tma vs triton (~6 min)
    w38c) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_tma_attention.py \
             tests/layers/test_encoder_attention.py tests/models/mllama/test_vision_plan.py tests/engine/test_gpu.py 2>&1 \
             | tee "$OUT/w38c_tests.log" | tail -3
           timeout 200 python3 -W ignore benchmarks/attn_tma_gpu.py 2>&1 | tee "$OUT/w38c_attn_tma.log" | grep -E "cudnn|BEST|dense|64x128 w4 s2|128x64 w4 s4"
           timeout 200 python3 -W ignore benchmarks/mllama_vision.py --size 11b --no-hf --runs 3 --shapes 4,1,mixed 2>&1 \
             | tee "$OUT/w38c_vision.log" | tail -6 ;;
    # wave 38, the tail masked through the score accumulator: GPU tests of the kernel and the vision plan on it,
    # the kernel at the Whisper and vision shapes, the 11B vision tower (~4 min)
    w38d) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_tma_attention.py \
             tests/layers/test_encoder_attention.py tests/models/mllama/test_vision_plan.py 2>&1 \
             | tee "$OUT/w38d_tests.log" | grep -E "^FAILED|passed|failed"
           timeout 150 python3 -W ignore benchmarks/attn_tma_gpu.py 2>&1 | tee "$OUT/w38d_attn_tma.log" | grep -vE "flash"
           timeout 150 python3 -W ignore benchmarks/mllama_vision.py --size 11b --no-hf --runs 3 --shapes 4,mixed 2>&1 \
             | tee "$OUT/w38d_vision.log" | tail -4 ;;
    # wave 39: GPU tests of wave 38's last commits (vision auto kernel, tma in encoder graphs), the default server at 1, 32
    # and 64 clients (issue 18), the engine under arrivals (issue 19) (~9 min)
    w39) timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_tma_attention.py \
             tests/layers/test_encoder_attention.py tests/models/mllama/test_vision_plan.py tests/models/mllama/test_gpu_graph.py 2>&1 \
             | tee "$OUT/w39_tests.log" | grep -E "^FAILED|passed|failed"
         (cd benchmarks && timeout 290 python3 -W ignore serve_gpu.py --concurrency 1 32 64 --longform 0 \
             --json "$OUT/w39_serve.json" 2>&1 | tee "$OUT/w39_serve.log" | grep -v "^Writing" \
             | grep -v "^#   [a-z_]* .*(n=" | grep -v "language guesses")
         timeout 100 python3 benchmarks/arrivals_gpu.py --arch large-v3 --budgets 24576 2>&1 \
             | tee "$OUT/w39_arrivals.log" | tail -4 ;;
    # wave 39: Mllama with self and cross layers sharing KV-pool layers: its GPU tests, then 16 and 64 image requests
    # against HF (issue 24's protocol, one strategy) (~5 min)
    w39-mllama) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/models/mllama/test_gpu_graph.py \
                  tests/models/mllama/test_engine.py tests/models/mllama/test_vision_plan.py 2>&1 \
                  | tee "$OUT/w39_mllama_tests.log" | grep -E "^FAILED|passed|failed"
                PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 330 python3 -W ignore benchmarks/mllama_gpu.py \
                  --size 11b --batches 16,64 --strategies aligned:128 --decode-steps 10 --repeats 2 \
                  --json "$OUT/w39_mllama.json" 2>&1 | tee "$OUT/w39_mllama.log" | grep -E "^(aligned|flat)|steps" ;;
    # wave 39: Mllama pixel values to the GPU by stack_pixels (valid tiles, cast on the device): GPU tests, the upload
    # timed against the old host cat + cast, then 64 image requests vs HF from this tree and _ab/before (~6 min)
    w40-fa3) export EDSERVE_FA3_LIB=$FA3_LIB
             timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fa3_attention.py \
               tests/layers/test_encoder_attention.py 2>&1 | tee "$OUT/w40_fa3_tests.log" | grep -E "^FAILED|passed|failed|Error"
             timeout 200 python3 -W ignore benchmarks/attn_tma_gpu.py 2>&1 | tee "$OUT/w40_attn.log" \
               | grep -E "^#|cudnn|BEST|fa3"
             timeout 200 python3 -W ignore benchmarks/prefill_gpu.py --arch large-v3 --batch 4 16 --variants tanh fa3 \
               --repeats 5 2>&1 | tee "$OUT/w40_prefill.log" | grep -vE "^ *$" | tail -30
             timeout 200 python3 -W ignore benchmarks/mllama_vision.py --size 11b --no-hf --runs 3 --shapes 4,mixed 2>&1 \
               | tee "$OUT/w40_vision.log" | tail -6 ;;
    w40-serve) export EDSERVE_FA3_LIB=$FA3_LIB
             timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py 2>&1 \
               | tee "$OUT/w40_serve_tests.log" | grep -E "^FAILED|passed|failed|Error"
             (cd benchmarks && timeout 430 python3 -W ignore serve_gpu.py --concurrency 32 --longform 0 \
               --serve-flags="--encoder-attention sdpa" --serve-flags="--encoder-attention fa3" \
               --serve-flags="--encoder-attention sdpa" --serve-flags="--encoder-attention fa3" \
               --json "$OUT/w40_serve.json" 2>&1 | tee "$OUT/w40_serve.log" \
               | grep -E "^(# engine|## |conc|32 )|steps (decode|mixed)") ;;
    w40-mllama) export EDSERVE_FA3_LIB=$FA3_LIB
             timeout 100 python3 -m pytest -q -p no:cacheprovider tests/models/mllama/test_gpu_graph.py \
               tests/models/mllama/test_vision_plan.py 2>&1 | tee "$OUT/w40_mllama_tests.log" | grep -E "^FAILED|passed|failed"
             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 470 python3 -W ignore benchmarks/mllama_gpu.py \
               --size 11b --batches 16,64 --strategies aligned:128:fa3,aligned:128:tma --decode-steps 10 --repeats 2 \
               --json "$OUT/w40_mllama.json" 2>&1 | tee "$OUT/w40_mllama.log" | grep -E "^(aligned|flat)|steps" ;;
    w40-arrivals) for form in sdpa fa3 sdpa fa3; do  # auto is fa3 with the library given, sdpa without
               lib=; [ $form = fa3 ] && lib=$FA3_LIB
               echo "--- $form"
               EDSERVE_FA3_LIB=$lib timeout 110 python3 benchmarks/arrivals_gpu.py --arch large-v3 --budgets 24576 2>&1 \
                 | tee -a "$OUT/w40_arrivals_$form.log" | tail -2
             done ;;
    w40-final) export EDSERVE_FA3_LIB=$FA3_LIB
             timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fa3_attention.py \
               tests/layers/test_encoder_attention.py tests/models/mllama/test_vision_plan.py 2>&1 \
               | tee "$OUT/w40_final_tests.log" | grep -E "^FAILED|passed|failed|Error"
             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 420 python3 -W ignore benchmarks/mllama_gpu.py \
               --size 11b --batches 1,16,64 --strategies aligned:128:fa3 --decode-steps 10 --repeats 2 \
               --json "$OUT/w40_final_mllama.json" 2>&1 | tee "$OUT/w40_final_mllama.log" | grep -E "^(aligned|flat)|steps" ;;
    w39-pixels) timeout 150 python3 -m pytest -q -p no:cacheprovider tests/models/mllama/test_gpu_graph.py \
                  tests/models/mllama/test_vision_plan.py tests/models/mllama/test_vision.py 2>&1 \
                  | tee "$OUT/w39_pixels_tests.log" | grep -E "^FAILED|passed|failed"
                timeout 100 python3 -W ignore benchmarks/mllama_pixels_gpu.py --images 16 64 2>&1 | tee "$OUT/w39_pixels.log"
                for tree in after before after; do  # from /tmp: the working directory's edserve/ must not shadow _ab's
                  pp=$PWD:$PWD/benchmarks:/tmp/site; [ $tree != after ] && pp=$PWD/_ab/$tree:$PWD/benchmarks:/tmp/site
                  echo "--- $tree"
                  (R=$PWD; cd /tmp && PYTHONPATH=$pp PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 150 python3 -W ignore \
                    "$R/benchmarks/mllama_gpu.py" --size 11b --batches 64 --strategies aligned:128 --decode-steps 4 --repeats 2 \
                    2>&1 | tee -a "$OUT/w39_pixels_ab_$tree.log" | grep -E "^(aligned|flat)|steps")
                done ;;
    # wave 38: issue 24's protocol at 16 and 64 image requests, the vision tower's attention on tma (the default on Hopper) vs
    # the pointer-load kernel (triton), medians of 2 (~8 min)
    w38-mllama) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 560 python3 -W ignore benchmarks/mllama_gpu.py \
               --size 11b --batches 16,64 --strategies aligned:128:tma,aligned:128:triton --decode-steps 10 --repeats 2 \
               --json "$OUT/w38_mllama.json" 2>&1 | tee "$OUT/w38_mllama.log" | grep -E "^(aligned|flat)" ;;
    # wave 38: the real path with this tree vs _ab/before (HEAD before the TMA attention), twice; the 11B vision tower
    # with the tma kernel vs triton / sdpa (~8 min)
    w38-b) realpath_ab w38_real 110 "after large-v3 64" "before large-v3 64" "after large-v3 64" "before large-v3 64"
           timeout 200 python3 -W ignore benchmarks/mllama_vision.py --size 11b --no-hf --runs 3 --shapes 4,mixed 2>&1 \
             | tee "$OUT/w38_vision.log" | tail -6 ;;
    # wave 38: the encoder's attention through TMA descriptors vs cuDNN, its GPU tests (~2 min)
    w38-attn) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_tma_attention.py 2>&1 \
             | tee "$OUT/w38_attn_tests.log" | tail -2
           timeout 300 python3 -W ignore benchmarks/attn_tma_gpu.py 2>&1 | tee "$OUT/w38_attn_tma.log" ;;
    w37) timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_sample_graphs.py \
             tests/models/test_step_mel.py tests/engine/test_step_clock.py tests/engine/test_gpu_sample_graphs.py \
             tests/engine/test_gpu_syncs.py tests/engine/test_gpu.py tests/engine/test_prompt_check.py \
             tests/chat/test_grammar_gpu.py 2>&1 | tee "$OUT/w37_tests.log" | tail -2
             (cd benchmarks && timeout 420 python3 -W ignore serve_gpu.py --concurrency 32 --longform 0 \
             --serve-flags=tree=../_ab/before0 --serve-flags=tree=../_ab/before --serve-flags= --serve-flags= \
             --json "$OUT/w37_ab.json" 2>&1 | tee "$OUT/w37_ab.log" \
             | grep -v "^Writing" | grep -v "^#   [a-z_]* .*(n=") ;;
    w36-capture) timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_sample_graphs.py \
             tests/models/test_step_mel.py tests/engine/test_step_clock.py tests/engine/test_gpu_sample_graphs.py tests/engine/test_beam_device.py tests/engine/test_gpu.py \
             tests/engine/test_prompt_check.py tests/chat/test_grammar_gpu.py 2>&1 | tee "$OUT/w36_tests.log" | tail -2
             (cd benchmarks && timeout 240 python3 -W ignore serve_gpu.py --concurrency 32 32 --longform 0 \
             --py-spy 3 --py-spy-at 32 --py-spy-target engine --json "$OUT/w36_capture.json" 2>&1 \
             | tee "$OUT/w36_capture.log" | grep -v "^#   [a-z_]* .*(n=") ;;
    w35-chat-load) timeout 150 python3 benchmarks/chat_load.py --save-random /tmp/mllama_small_bytes --size small \
             --byte-tokenizer 2>&1 | tail -1
             for fmt in text json_object; do
               timeout 200 python3 -W ignore benchmarks/chat_load.py --serve /tmp/mllama_small_bytes --clients 32 \
               --requests 128 --max-tokens 64 --response-format $fmt --json "$OUT/w35_chat_load_$fmt.json" 2>&1 \
               | tee "$OUT/w35_chat_load_$fmt.log" | tail -1
             done ;;
    w35-chat) timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/chat/test_grammar_gpu.py \
             2>&1 | tee "$OUT/w35_tests.log" | tail -2
             timeout 200 python3 benchmarks/grammar_steps.py --device cuda --rows 1,8,32,64 \
             --json "$OUT/w35_grammar.json" 2>&1 | grep -v "^Writing" | tee "$OUT/w35_grammar.log" ;;
    w34-defaults) timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_admission.py \
             tests/models/test_step_mel.py 2>&1 | tee "$OUT/w34_tests.log" | tail -2
             (cd benchmarks && timeout 170 python3 -W ignore serve_gpu.py --concurrency 32 --requests 192 \
             --json "$OUT/w34_defaults.json" 2>&1 | tee "$OUT/w34_defaults.log" | grep -v "^Writing" \
             | grep -v "^#   [a-z_]* .*(n=" | grep -v "language guesses")
             realpath_ab w34_real 110 "after large-v3 64"
             timeout 100 python3 benchmarks/arrivals_gpu.py --arch large-v3 --budgets 24576 2>&1 \
             | tee "$OUT/w34_arrivals_default.log" | tail -4 ;;
    w33-last) (cd benchmarks && timeout 150 python3 -W ignore serve_gpu.py --concurrency 32 --longform 0 --requests 192 \
             --json "$OUT/w33_guess.json" 2>&1 | tee "$OUT/w33_guess.log" | grep -v "^Writing")
             timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_encoder_graphs.py \
             "tests/models/mllama/test_gpu_graph.py::test_top_logprobs_in_sampling_graphs_equal_eager" 2>&1 \
             | tee "$OUT/w33_tests.log" | tail -2 ;;
    w33-guess) timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_encoder_graphs.py \
             "tests/models/mllama/test_gpu_graph.py::test_top_logprobs_in_sampling_graphs_equal_eager" 2>&1 \
             | tee "$OUT/w33_tests.log" | tail -2
             (cd benchmarks && timeout 200 python3 -W ignore serve_gpu.py --concurrency 32 --longform 0 \
             --json "$OUT/w33_guess.json" 2>&1 | tee "$OUT/w33_guess.log" | grep -v "^Writing")
             (cd benchmarks && timeout 200 python3 -W ignore serve_gpu.py --concurrency 32 --longform 0 \
             --bench-field language=en --json "$OUT/w33_en.json" 2>&1 | tee "$OUT/w33_en.log" | grep -v "^Writing") ;;
    w32-serve) (cd benchmarks && timeout 420 python3 -W ignore serve_gpu.py --concurrency 1 32 --longform 0 --py-spy 4 \
             --py-spy-at 32 --py-spy-target engine --json "$OUT/w32_serve.json" 2>&1 | tee "$OUT/w32_serve.log" \
             | grep -v "^#   [a-z_]* .*(n=") ;;
    serve-full) (cd benchmarks && timeout 480 python3 -W ignore serve_gpu.py --json "$OUT/serve_full.json" 2>&1 \
             | tee "$OUT/serve_full.log" | grep -v "^#   [a-z_]* .*(n=") ;;
    # wave 13: the GPU log-mel test, the log-mel timings, the decode step's kernels at 64 rows (~2 min)
    w13-tests) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/audio/test_chunked_mel.py tests/engine/test_triton_engine.py \
             tests/kernels/test_grouped_cross_attention.py tests/engine/test_gpu_syncs.py tests/engine/test_gpu.py -rs 2>&1 \
             | tee "$OUT/w13_tests.log" | tail -5
           timeout 120 python3 benchmarks/mel_gpu.py 2>&1 | tee "$OUT/mel_gpu.log" ;;
    decode-kernels) (cd benchmarks && timeout 200 python3 -W ignore whisper_realpath.py --arch large-v3 --concurrency 64 \
             --config flat:128 --kernels 30 2>&1 | grep -v "custom logits" | tee "$OUT/decode_kernels.log" | tail -40) ;;
    # wave 14: where the GPU waits for the host (beam 5 at 64, one row, 64 rows) and the kernels of
    # a one-row step and a beam step (~5 min)
    w14-profile) (cd benchmarks && timeout 300 python3 -W ignore gpu_idle.py --scenarios beam64 decode1 decode64 --rows 25 \
             2>&1 | grep -v "custom logits" | tee "$OUT/gpu_idle.log" | grep -v "^| .* | 0.0 |")
           (cd benchmarks && timeout 150 python3 -W ignore whisper_realpath.py --arch large-v3 --concurrency 1 \
             --config flat:128 --kernels 40 2>&1 | grep -v "custom logits" | tee "$OUT/kernels_1row.log" | tail -42)
           (cd benchmarks && timeout 200 python3 -W ignore beam_gpu.py --concurrency 64 --configs flat:128 --beam 5 --no-hf --beam-on-device \
             --beam-on-device --profile 40 2>&1 | grep -v "custom logits" | tee "$OUT/beam_kernels.log" | tail -60) ;;
    # wave 20: the GPU beam and sampling-graph tests on the tree after the shared capture helper (~2 min)
    w20-verify) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_beam.py \
             tests/engine/test_gpu_sample_graphs.py tests/engine/test_beam_run_graph.py tests/dp/test_features.py \
             tests/dp/test_mel_store.py -rs 2>&1 \
             | grep -v "Loading weights" | tee "$OUT/w20_verify.log" | tail -8 ;;
    # wave 21: beam candidates by the one-pass Triton top-k: GPU tests, the decoder GEMMs at decode rows, then beam 5 vs
    # greedy at 64 (large-v3 flat/128, forced 100 tokens), alternating the new top-k and torch.topk (~8 min)
    w21-beam) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_row_topk.py tests/engine/test_gpu_beam.py \
             tests/engine/test_gpu_sample_graphs.py -rs 2>&1 | grep -v "Loading weights" | tee "$OUT/w21_beam_tests.log" | tail -3
           timeout 120 python3 -W ignore benchmarks/decode_gemm_gpu.py 2>&1 | tee "$OUT/w21_decode_gemm.log"
           for round in 1 2; do for flag in "" --torch-topk; do
             echo "--- round $round ${flag:-(triton top-k)}"
             prof=""; [ "$round$flag" = "1" ] && prof="--profile 14"
             (cd benchmarks && timeout 150 python3 -W ignore beam_gpu.py --concurrency 64 --configs flat:128 --beam 5 \
               --beam-on-device --no-hf $flag $prof 2>&1 | grep -v "custom logits" | tee -a "$OUT/w21_beam_ab.log" | grep -E "^flat|^#  ")
           done; done ;;
    # wave 21: the top-k kernel's launch shapes, a third beam A/B round, the real path (flat and aligned /128) and
    # arrivals on this wave's tree (~9 min)
    w21-final) timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_row_topk.py 2>&1 | tail -1
           timeout 100 python3 -W ignore benchmarks/row_topk_gpu.py 2>&1 | tee "$OUT/w21_row_topk.log"
           for flag in "" --torch-topk; do
             echo "--- round 3 ${flag:-(triton top-k)}"
             (cd benchmarks && timeout 150 python3 -W ignore beam_gpu.py --concurrency 64 --configs flat:128 --beam 5 \
               --beam-on-device --no-hf $flag 2>&1 | grep -v "custom logits" | tee -a "$OUT/w21_beam_ab3.log" | grep -E "^flat")
           done
           for cfg in flat:128 aligned:128; do
             (cd benchmarks && timeout 200 python3 -W ignore whisper_realpath.py --arch large-v3 --concurrency 64 \
               --config $cfg --overlap on 2>&1 | grep -v "custom logits" | tee -a "$OUT/w21_real.log" | tail -3)
           done
           timeout 200 python3 benchmarks/arrivals_gpu.py --arch large-v3 --budgets 24576 2>&1 | tee "$OUT/w21_arrivals.log" | tail -4 ;;
    # wave 21: the final tree's GPU tests (encoder, engine, syncs, prompt graphs, Mllama graphs), then beam 5 on the
    # transcription path (EOS + timestamp rules) with the Triton top-k vs torch.topk (~7 min)
    w21-verify) timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_encoder_graphs.py \
             tests/models/test_whisper_encoder.py tests/engine/test_gpu.py tests/engine/test_gpu_syncs.py \
             tests/engine/test_gpu_prompt_graphs.py tests/models/mllama/test_gpu_graph.py -rs 2>&1 \
             | grep -v "Loading weights" | tee "$OUT/w21_verify.log" | tail -5
           timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_row_topk.py 2>&1 | tee -a "$OUT/w21_verify.log" | tail -1
           for flag in "" --torch-topk; do
             echo "--- EOS + timestamps ${flag:-(triton top-k)}"
             (cd benchmarks && timeout 150 python3 -W ignore beam_gpu.py --concurrency 64 --configs flat:128 --beam 5 \
               --beam-on-device --eos-timestamps $flag 2>&1 | grep -v "custom logits" | tee -a "$OUT/w21_beam_eos.log" | grep -E "^flat")
           done ;;
    # wave 20: long-form with the log-mels held by the engine worker (default) vs sent back
    # (--held-log-mel-mb 0), alternating; W20_ORDER picks the order (~1.5 min per run)
    w20-long) for mode in ${W20_ORDER:-held values}; do
             case $mode in values) flags="--held-log-mel-mb 0";; *) flags="";; esac
             echo "--- $mode"
             (cd benchmarks && timeout 280 python3 -W ignore serve_gpu.py --concurrency 1 --requests 32 --serve-flags="$flags" \
               --json "$OUT/serve_w20_long_$mode.json" 2>&1 | tee "$OUT/serve_w20_long_$mode.log" | grep -E "^long-form|engine:|long-form API")
           done ;;
    # wave 20: beam 5 vs greedy vs HF num_beams=5 at 64 (forced length), then the transcription path (EOS + timestamps) (~8 min)
    w20-beam) (cd benchmarks && timeout 330 python3 -W ignore beam_gpu.py --concurrency 64 --configs flat:128 --beam 5 \
                --beam-on-device --repeats 2 2>&1 | grep -v "custom logits" | tee "$OUT/w20_beam_hf.log" | tail -12)
              (cd benchmarks && timeout 200 python3 -W ignore beam_gpu.py --concurrency 64 --configs flat:128 --beam 5 \
                --beam-on-device --eos-timestamps 2>&1 | grep -v "custom logits" | tee "$OUT/w20_beam_eos.log" | tail -10) ;;
    # wave 20: short clips with every log-mel on the engine's GPU (held there) vs the default
    # (audio workers under load), 1/32/64 clients (~4 min)
    w20-short) (cd benchmarks && timeout 420 python3 -W ignore serve_gpu.py --concurrency 1 32 64 --longform 0 \
                --serve-flags= --serve-flags="--device-features-above-s 0" --json "$OUT/serve_w20_short.json" 2>&1 \
                | tee "$OUT/serve_w20_short.log" | grep -v "^#   [a-z_]* .*(n=" | grep -v "^#   steps") ;;
    # wave 14: sampling graphs: GPU tests, host idle at 64 rows and one row, the real path on/off (~6 min)
    w14-sample) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_sample_graphs.py \
             tests/engine/test_gpu_syncs.py tests/engine/test_gpu_prompt_graphs.py tests/engine/test_gpu.py -rs 2>&1 \
             | grep -v "Loading weights" | tee "$OUT/w14_tests.log" | tail -4
           (cd benchmarks && timeout 200 python3 -W ignore gpu_idle.py --scenarios decode64 decode1 --rows 12 \
             2>&1 | grep -v "custom logits" | tee "$OUT/gpu_idle.log" | grep -v "^| .* | 0.0 |")
           for sg in on off; do
             (cd benchmarks && timeout 200 python3 -W ignore whisper_realpath.py --arch large-v3 --concurrency 64 \
               --config flat:128 --overlap on --sampling-graph $sg 2>&1 | grep -v "custom logits" | tee -a "$OUT/real_flat.log" | tail -3)
           done ;;
    # wave 14: the server with sampling graphs: defaults vs log-mels of every upload on the GPU (~7 min)
    w14-serve) (cd benchmarks && timeout 560 python3 -W ignore serve_gpu.py --concurrency 1 32 64 128 --json "$OUT/serve_w14.json" \
             --serve-flags= --serve-flags='--device-features-above-s 0' 2>&1 \
             | tee "$OUT/serve_w14.log" | grep -v "^#   [a-z_]* .*(n=") ;;
    # wave 15: compact windows to the engine process (GPU staging tests, then the server, ~6 min)
    w15-serve) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/models/test_mel_staging.py -rs 2>&1 \
             | tee "$OUT/w15_tests.log" | tail -3
           (cd benchmarks && timeout 420 python3 -W ignore serve_gpu.py --concurrency 1 32 64 --longform 0 \
             --json "$OUT/serve_w15.json" 2>&1 | tee "$OUT/serve_w15.log" | grep -v "^#   [a-z_]* .*(n=") ;;
    # wave 16: prompt tokens as graph rows + guessed languages checked by the prefill (~7 min):
    # GPU tests, then the server on this tree, on the tree before (copied to _ab/before,
    # untracked), and on this tree again (interleaved A/B)
    w16-ab) timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu_prompt_graphs.py \
             tests/engine/test_prompt_check.py tests/engine/test_gpu_syncs.py tests/engine/test_prefill_syncs.py -rs 2>&1 \
             | grep -v "Loading weights" | tee "$OUT/w16_tests.log" | tail -4
           rm -rf /tmp/after && mkdir -p /tmp/after/benchmarks && cp -r edserve /tmp/after/ && cp benchmarks/serve_gpu.py /tmp/after/benchmarks/
           for tree in after before after2; do
             src=/tmp/after; [ $tree = before ] && src=_ab/before
             cp -r $src/edserve . && cp $src/benchmarks/serve_gpu.py benchmarks/
             echo "--- $tree"
             (cd benchmarks && timeout 300 python3 -W ignore serve_gpu.py --concurrency 1 32 64 --longform 0 \
               --json "$OUT/serve_w16_$tree.json" 2>&1 | tee "$OUT/serve_w16_$tree.log" | grep -v "^#   [a-z_]* .*(n=")
           done ;;
    # wave 16: in-row detection vs guessed vs given language, one engine, alternated (~2 min)
    w16-guess) (cd benchmarks && timeout 400 python3 -W ignore guess_gpu.py 2>&1 | grep -v Writing | tee "$OUT/guess_gpu.log") ;;
    # long-form through the server vs the engine's driver, 16 x 10 min (~5 min)
    w16-long) (cd benchmarks && timeout 500 python3 -W ignore serve_gpu.py --concurrency 1 --requests 32 \
             --json "$OUT/serve_w16_long.json" 2>&1 | tee "$OUT/serve_w16_long.log" | grep -v "^#   [a-z_]* .*(n=") ;;
    # wave 16: uploads to the audio workers through shared-memory slots, interleaved A/B at 32
    # clients (~6 min; the pipe-only audio_pool.py copied to _ab/slots_before, untracked)
    w16-slots) cp edserve/server/audio_pool.py /tmp/audio_pool_after.py
           for tree in after before after2 before2; do
             src=/tmp/audio_pool_after.py; case $tree in before*) src=_ab/slots_before/audio_pool.py;; esac
             cp $src edserve/server/audio_pool.py
             echo "--- $tree"
             (cd benchmarks && timeout 200 python3 -W ignore serve_gpu.py --concurrency 32 --longform 0 \
               --json "$OUT/serve_w16_slots_$tree.json" 2>&1 | tee "$OUT/serve_w16_slots_$tree.log" | grep -E "^ +32 |engine:")
           done ;;
    # wave 16: the 11B vision tower's kernel table (issue 24's prefill), 4-tile and mixed batches (~2 min)
    # wave 17: attention at the vision tower's head dim 80, native vs zero-padded, per backend (~1 min)
    w17-attn) timeout 150 python3 -W ignore benchmarks/attn_headdim.py 2>&1 | tee "$OUT/attn_headdim.log" ;;
    # wave 17: audio jobs sent from the event loop (zmq) vs ProcessPoolExecutor, interleaved at
    # 1 and 32 clients (~7 min; the executor's audio_pool.py copied to _ab/w17_before, untracked)
    w17-ab) cp edserve/server/audio_pool.py /tmp/audio_pool_after.py
           for tree in after before after2 before2; do
             src=/tmp/audio_pool_after.py; case $tree in before*) src=_ab/w17_before/audio_pool.py;; esac
             cp $src edserve/server/audio_pool.py
             echo "--- $tree"
             (cd benchmarks && timeout 240 python3 -W ignore serve_gpu.py --concurrency 1 32 --longform 0 \
               --json "$OUT/serve_w17_$tree.json" 2>&1 | tee "$OUT/serve_w17_$tree.log" | grep -E "^ +(1|32) |engine:")
           done
           cp /tmp/audio_pool_after.py edserve/server/audio_pool.py ;;
    # wave 17: long-form (16 x 10 min) with audio jobs from the event loop vs the process pool (~4 min)
    w17-long) cp edserve/server/audio_pool.py /tmp/audio_pool_after.py
           for tree in after before; do
             src=/tmp/audio_pool_after.py; case $tree in before*) src=_ab/w17_before/audio_pool.py;; esac
             cp $src edserve/server/audio_pool.py
             echo "--- $tree"
             (cd benchmarks && timeout 280 python3 -W ignore serve_gpu.py --concurrency 1 --requests 32 \
               --json "$OUT/serve_w17_long_$tree.json" 2>&1 | tee "$OUT/serve_w17_long_$tree.log" | grep -E "^long-form|engine:")
           done
           cp /tmp/audio_pool_after.py edserve/server/audio_pool.py ;;
    # wave 17: a shorter GPU soak on the event-loop audio dispatcher (4,000 at 256, ~3 min)
    w17-soak) (cd benchmarks && timeout 240 python3 -W ignore soak_gpu.py --requests 4000 --concurrency 256 \
             --json "$OUT/soak_w17.json" 2>&1 | tee "$OUT/soak_w17.log" | tail -12) ;;
    w16-vision) timeout 150 python3 -W ignore benchmarks/mllama_vision.py --size 11b --no-hf --runs 2 \
             --shapes 4,mixed --profile 2>&1 | grep -v "USDT\|profiler_st" | tee "$OUT/mllama_vision_profile.log" ;;
    # wave 14 final: GPU tests, decode kernels at 1 and 64 rows, the real path, the server (~8 min)
    w14-final) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_sample_graphs.py \
             tests/engine/test_gpu_syncs.py tests/engine/test_gpu.py tests/layers/test_linear_gelu.py -rs 2>&1 \
             | grep -v "Loading weights" | tee "$OUT/w14_tests.log" | tail -4
           for c in 1 64; do
             (cd benchmarks && timeout 150 python3 -W ignore whisper_realpath.py --arch large-v3 --concurrency $c \
               --config flat:128 --kernels 14 2>&1 | grep -v "custom logits" | tee -a "$OUT/decode_kernels.log" | tail -15)
           done
           (cd benchmarks && timeout 200 python3 -W ignore whisper_realpath.py --arch large-v3 --concurrency 64 \
             --config flat:128 --overlap on 2>&1 | grep -v "custom logits" | tee "$OUT/real_flat.log" | tail -3)
           (cd benchmarks && timeout 300 python3 -W ignore serve_gpu.py --json "$OUT/serve_full.json" 2>&1 \
             | tee "$OUT/serve_full.log" | grep -v "^#   [a-z_]* .*(n=")
           (cd benchmarks && timeout 200 python3 -W ignore gpu_idle.py --scenarios serve --rows 8 \
             2>&1 | grep -v "custom logits" | tee "$OUT/gpu_idle_serve.log" | grep -v "^| .* | 0.0 |" | tail -30) ;;
    # wave 14: where the in-process server's host<->device syncs come from (thread + frame) (~2.5 min)
    w14-syncs) (cd benchmarks && timeout 200 python3 -W ignore gpu_idle.py --scenarios serve --rows 6 \
             2>&1 | grep -v "custom logits" | tee "$OUT/gpu_idle_serve.log" | grep -v "^| .* | 0.0 |" | tail -24) ;;
    # issue 22: beam 5 (beams chosen on the device, the CUDA default) vs greedy at 64 requests, flat/128, and the GPU beam tests (~3 min)
    beam-flat) timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_beam.py -rs 2>&1 \
             | grep -v "Loading weights" | tee "$OUT/beam_tests.log" | tail -3
           (cd benchmarks && timeout 200 python3 -W ignore beam_gpu.py --concurrency 64 --configs flat:128 --beam 5 --no-hf --beam-on-device \
             2>&1 | grep -v "custom logits" | tee "$OUT/beam_flat.log" | tail -12) ;;
    # issue 19's real-path protocol on the default strategy only (flat/128, overlap on) (~2 min)
    real-flat) (cd benchmarks && timeout 240 python3 -W ignore whisper_realpath.py --arch large-v3 --concurrency 64 \
             --config flat:128 --overlap on 2>&1 | grep -v "custom logits" | tee "$OUT/real_flat.log" | tail -4) ;;
    # issue 22: greedy rows beside one beam request, device vs host beams, large-v3 and tiny.en (~5 min)
    w18-mix) (cd benchmarks && timeout 560 python3 -W ignore beam_mix_gpu.py --arch large-v3 tiny.en \
             --greedy 64 256 --repeats 2 2>&1 | grep -v "custom logits" | tee "$OUT/beam_mix.log") ;;
    # wave 18: long-form (16 x 10 min): 4 feature threads + int16 samples to the engine process vs before (~6 min)
    w18-long) files="edserve/dp/features.py edserve/audio/prepare.py edserve/audio/device_mel.py edserve/audio/wav_pcm.py edserve/server/transcription.py"
           mkdir -p /tmp/w18_after; for f in $files; do cp $f /tmp/w18_after/; done
           for tree in ${W18_TREES:-after before after2}; do
             for f in $files; do
               case $tree in before*) cp _ab/w18_before/$(basename $f) $f;; *) cp /tmp/w18_after/$(basename $f) $f;; esac
             done
             echo "--- $tree"
             (cd benchmarks && timeout 250 python3 -W ignore serve_gpu.py --concurrency 1 --requests 32 \
               --json "$OUT/serve_w18_long_$tree.json" 2>&1 | tee "$OUT/serve_w18_long_$tree.log" | grep -E "^long-form|engine:")
           done
           for f in $files; do cp /tmp/w18_after/$(basename $f) $f; done ;;
    # the host's time per step of a tiny.en batch with one beam request (cProfile) (~1 min)
    w18-mixprof) (cd benchmarks && timeout 300 python3 -W ignore beam_mix_gpu.py --arch tiny.en \
             --greedy 64 --repeats 1 --profile 45 2>&1 | grep -v "custom logits" | tee "$OUT/beam_mix_prof.log" \
             | grep -v "^ *[0-9/]* *0.000 *0.000 *0.00[0-9] *0.000" | head -200) ;;
    # wave 19: is the mixed batch (greedy rows + one beam) bound by the device or the host? GPU busy + kernels per step (~3 min)
    w19-mixkern) (cd benchmarks && timeout 400 python3 -W ignore beam_mix_gpu.py --arch ${W19_ARCH:-tiny.en large-v3} \
             --greedy 64 --repeats 1 --kernels ${W19_KERNELS:-22} 2>&1 | grep -v "custom logits" | tee "$OUT/beam_mix_kernels.log") ;;
    # wave 19: the beam step's work after sampling as CUDA graphs: GPU beam tests, mixed batches, beam 5 vs greedy at 64 (~7 min)
    w19-beamgraph) timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu_beam.py -rs 2>&1 \
             | grep -v "Loading weights" | tee "$OUT/beam_tests.log" | grep -E "passed|failed|error|syncs in" | tail -8
           (cd benchmarks && timeout 300 python3 -W ignore beam_mix_gpu.py --arch tiny.en large-v3 --greedy 64 --repeats 2 \
             --kernels 6 2>&1 | grep -v "custom logits" | tee "$OUT/beam_mix_graph.log" | grep -v "^#   ")
           (cd benchmarks && timeout 240 python3 -W ignore beam_gpu.py --concurrency 64 --configs flat:128 --beam 5 --no-hf --beam-on-device \
             2>&1 | grep -v "custom logits" | tee "$OUT/beam_flat_graph.log" | tail -12) ;;
    # wave 19 A/B in one call: mixed batches with the beam step's work as graphs vs only the choice as a graph, twice (~4 min)
    w19-mixab) for round in 1 2; do for flag in "" --no-run-graphs; do
             echo "--- round $round ${flag:-(run graphs)}"
             (cd benchmarks && timeout 200 python3 -W ignore beam_mix_gpu.py --arch tiny.en large-v3 --greedy 64 --repeats 3 \
               $flag 2>&1 | grep -v "custom logits" | tee -a "$OUT/beam_mix_ab.log" | tail -2)
           done; done ;;
    # wave 19: beam rows' top-k inside the sampling graphs too: GPU tests, then A/B of the three paths, twice (~6 min)
    w19-mixab2) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_sample_graphs.py tests/engine/test_gpu_beam.py -rs 2>&1 \
             | grep -v "Loading weights" | tee "$OUT/sample_beam_tests.log" | tail -3
           for round in 1 2; do for flag in "" --no-candidate-graphs "--no-candidate-graphs --no-run-graphs"; do
             echo "--- round $round ${flag:-(both graphs)}"
             (cd benchmarks && timeout 200 python3 -W ignore beam_mix_gpu.py --arch tiny.en large-v3 --greedy 64 --repeats 3 \
               $flag 2>&1 | grep -v "custom logits" | tee -a "$OUT/beam_mix_ab2.log" | tail -2)
           done; done
           (cd benchmarks && timeout 120 python3 -W ignore beam_mix_gpu.py --arch tiny.en --greedy 64 --repeats 1 --kernels 25 \
             2>&1 | grep -v "custom logits" | tee "$OUT/beam_mix_kernels_after.log" | grep -E "GPU busy|^tiny") ;;
    # long-form with the log-mels on the GPU (default) vs on the audio workers (~4 min)
    serve-mel) (cd benchmarks && timeout 420 python3 -W ignore serve_gpu.py --concurrency 32 --json "$OUT/serve_mel.json" \
             --serve-flags= --serve-flags='--device-features-above-s -1' 2>&1 \
             | tee "$OUT/serve_mel.log" | grep -v "^#   [a-z_]* .*(n=") ;;
  esac
done
