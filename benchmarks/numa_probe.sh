#!/usr/bin/env bash
# Does CPU placement change the 1.5B forward pass? Fresh processes, unpinned and under taskset.
# Results: benchmarks/results/host_noise_h200x2.json
nvidia-smi topo -m; lscpu | grep -i "numa\|model name\|socket\|thread"; which numactl taskset
P="python benchmarks/profile_engine.py --model qwen2_1_5b --repeats 8 --no-profile"
for i in 1 2 3 4; do CUDA_VISIBLE_DEVICES=0 $P 2>&1 | grep median; done
N0=$(lscpu | awk -F: '/NUMA node0 CPU/{gsub(/ /,"",$2);print $2}'); N1=$(lscpu | awk -F: '/NUMA node1 CPU/{gsub(/ /,"",$2);print $2}')
echo "node0=$N0 node1=$N1"
for c in "$N0" "$N1" 0-3 16-19; do [ -n "$c" ] || continue; for i in 1 2; do echo -n "cpus $c: "; CUDA_VISIBLE_DEVICES=0 taskset -c $c $P 2>&1 | grep median; done; done
