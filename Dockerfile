# hybridflow on GPUs: CUDA PyTorch base + megatron-core + transformer-engine.
#   docker build -t hybridflow .
#   docker run --gpus all --ipc=host -v $PWD/outputs:/workspace/hybridflow/outputs hybridflow \
#       torchrun --nproc_per_node 8 -m hybridflow.train model=qwen2_1_5b ...
FROM nvcr.io/nvidia/pytorch:25.09-py3

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
WORKDIR /workspace/hybridflow

# The base image's torch stays: pin it so nothing below replaces it.
RUN python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > /tmp/constraints.txt

COPY pyproject.toml README.md ./
COPY hybridflow ./hybridflow
COPY launch ./launch
RUN PIP_CONSTRAINT=/tmp/constraints.txt pip install --no-cache-dir -e ".[gpu,gguf]" \
 && python -c "import megatron.core, transformer_engine, hybridflow; print('ok')"

COPY tests ./tests
COPY benchmarks ./benchmarks
CMD ["python", "-m", "hybridflow.train", "--cfg"]
