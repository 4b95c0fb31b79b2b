# train_llama: FP8 (COAT) pretraining of Llama models in C and CUDA.
#   make            build ./train_llama and ./tokenize
#   make test       build everything, run the CPU tests, and the GPU tests when a GPU is present
#   make test-gpu   run the GPU tests whatever nvidia-smi says
#   make bench      GPU benchmarks beside the PyTorch reference
#   make clean
# snprintf cuts messages to their buffers on purpose, hence -Wno-format-truncation.
# Options: GPU_ARCH=90a (default, Hopper), CUDA_HOME=/usr/local/cuda, NO_MPI=1, NO_NCCL=1, NO_ZSTD=1.

CC ?= cc
CUDA_HOME ?= /usr/local/cuda
NVCC ?= $(CUDA_HOME)/bin/nvcc
GPU_ARCH ?= 90a
BUILD := build
comma := ,

CFLAGS := -std=c11 -O2 -g -Wall -Wextra -Wno-format-truncation -Werror -pthread -D_DEFAULT_SOURCE -D_FILE_OFFSET_BITS=64
NVCC_HOST_FLAGS := -Wall,-Wextra,-Wno-format-truncation
NVCCFLAGS := -std=c++17 -O3 -g -lineinfo --Werror all-warnings -Xcompiler $(NVCC_HOST_FLAGS) \
             -gencode arch=compute_$(GPU_ARCH),code=sm_$(GPU_ARCH) -DTRAIN_LLAMA_GPU_ARCH='"sm_$(GPU_ARCH)"'
NVCC_LIBS := -lcublasLt -lz

# ---- dependencies: one line each, found or missing -------------------------------------
ifeq ($(wildcard $(NVCC)),)
$(error CUDA: nvcc not found at $(NVCC); set CUDA_HOME or NVCC)
endif
$(info CUDA: $(shell $(NVCC) --version | grep -o 'release [0-9.]*'), building for sm_$(GPU_ARCH) (GPU_ARCH=...))
CUDA_INCLUDE := $(CUDA_HOME)/include
ifeq ($(wildcard $(CUDA_INCLUDE)/cublasLt.h),)
$(error cuBLASLt: cublasLt.h not found under $(CUDA_INCLUDE))
endif
$(info cuBLASLt: found)

NCCL_HEADER := $(firstword $(wildcard $(CUDA_INCLUDE)/nccl.h /usr/include/nccl.h))
ifeq ($(NO_NCCL),1)
$(info NCCL: disabled (NO_NCCL=1): single-GPU build)
else ifeq ($(NCCL_HEADER),)
$(info NCCL: missing (no nccl.h): single-GPU build)
else
$(info NCCL: found ($(NCCL_HEADER)))
NVCCFLAGS += -DUSE_NCCL
NVCC_LIBS += -lnccl
endif

MPI_COMPILE := $(shell mpicc --showme:compile 2>/dev/null)
MPI_LINK := $(shell mpicc --showme:link 2>/dev/null)
ifeq ($(NO_MPI),1)
$(info MPI: disabled (NO_MPI=1): single-process build)
else ifeq ($(MPI_LINK),)
$(info MPI: missing (mpicc --showme failed): single-process build)
else
$(info MPI: found (mpicc --showme))
HAVE_MPI := 1
NVCCFLAGS += -DUSE_MPI $(filter -I%,$(MPI_COMPILE))
NVCC_LIBS += $(foreach flag,$(MPI_LINK),$(if $(filter -Wl%,$(flag)),-Xlinker $(subst -Wl$(comma),,$(flag)),$(flag)))
endif

# zlib (required): the checkpoints' CRC-32 checksums, and .gz inputs of ./tokenize shards;
# libzstd (optional): .zst inputs (tokenizer/input_file.c). Headers as the C compiler finds them.
has_header = $(shell printf '\043include <$(1)>\n' | $(CC) -E -x c - >/dev/null 2>&1 && echo 1)
ifneq ($(call has_header,zlib.h),1)
$(error zlib: missing (no zlib.h; apt-get install zlib1g-dev): checkpoint checksums need it)
endif
$(info zlib: found (checkpoint checksums, .gz inputs))
CFLAGS += -DUSE_ZLIB
TOKENIZER_LIBS := -lz
ifeq ($(NO_ZSTD),1)
$(info libzstd: disabled (NO_ZSTD=1): tokenize refuses .zst inputs)
else ifneq ($(call has_header,zstd.h),1)
$(info libzstd: missing (no zstd.h; apt-get install libzstd-dev): tokenize refuses .zst inputs)
else
$(info libzstd: found (.zst inputs))
CFLAGS += -DUSE_ZSTD
TOKENIZER_LIBS += -lzstd
endif

# ---- programs --------------------------------------------------------------------------
TOKENIZER_LIB_SRCS := $(filter-out tokenizer/tokenize.c,$(wildcard tokenizer/*.c))
TOKENIZER_LIB := $(BUILD)/libtokenizer.a
COAT_HEADERS := $(wildcard coat/*.h coat/*.cuh dataloader/*.h)

.PHONY: all test test-cpu test-gpu bench clean
all: train_llama tokenize

train_llama: train_llama.cu $(COAT_HEADERS) $(TOKENIZER_LIB)
	$(NVCC) $(NVCCFLAGS) $< $(TOKENIZER_LIB) -o $@ $(NVCC_LIBS) $(TOKENIZER_LIBS)

tokenize: tokenizer/tokenize.c $(TOKENIZER_LIB) $(wildcard tokenizer/*.h dataloader/*.h)
	$(CC) $(CFLAGS) $< $(TOKENIZER_LIB) -o $@ -lm $(TOKENIZER_LIBS)

$(BUILD)/tokenizer/%.o: tokenizer/%.c $(wildcard tokenizer/*.h dataloader/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(TOKENIZER_LIB): $(patsubst %.c,$(BUILD)/%.o,$(TOKENIZER_LIB_SRCS))
	@mkdir -p $(dir $@)
	rm -f $@
	$(if $^,ar rcs $@ $^,ar rcs $@)

# ---- tests -----------------------------------------------------------------------------
# test/test_*.c run on the CPU; test/test_*.cu need a GPU. CPU tests link the tokenizer and
# the double-precision CPU reference; GPU tests link the FP32 CPU reference.
CPU_TESTS := $(patsubst test/%.c,$(BUILD)/%,$(wildcard test/test_*.c))
GPU_TESTS := $(patsubst test/%.cu,$(BUILD)/%,$(wildcard test/test_*.cu))
REFERENCE_DOUBLE := $(BUILD)/libreference_double.a
REFERENCE_FLOAT := $(BUILD)/libreference_float.a
TEST_HEADERS := $(wildcard test/*.h test/*.cuh)

$(BUILD)/reference_double.o: test/reference_llama.c $(TEST_HEADERS) $(COAT_HEADERS)
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS) -DREF_REAL=double -c $< -o $@
$(BUILD)/reference_float.o: test/reference_llama.c $(TEST_HEADERS) $(COAT_HEADERS)
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS) -c $< -o $@
.SECONDARY: $(REFERENCE_DOUBLE) $(REFERENCE_FLOAT) $(BUILD)/reference_double.o $(BUILD)/reference_float.o
$(BUILD)/lib%.a: $(BUILD)/%.o
	rm -f $@ && ar rcs $@ $<

$(BUILD)/test_%: test/test_%.c $(TOKENIZER_LIB) $(REFERENCE_DOUBLE) $(TEST_HEADERS) $(COAT_HEADERS) $(wildcard tokenizer/*.h)
	$(CC) $(CFLAGS) -DREF_REAL=double $< $(TOKENIZER_LIB) $(REFERENCE_DOUBLE) -o $@ -lm $(TOKENIZER_LIBS)

$(BUILD)/test_%: test/test_%.cu $(REFERENCE_FLOAT) $(TEST_HEADERS) $(COAT_HEADERS)
	$(NVCC) $(NVCCFLAGS) $< $(REFERENCE_FLOAT) -o $@ $(NVCC_LIBS)

# Built for another architecture than the GPU's on purpose: the refusal of a GPU without code.
$(BUILD)/test_gpu_arch: test/test_gpu_arch.cu $(TEST_HEADERS) coat/common.cuh
	@mkdir -p $(BUILD)
	$(NVCC) -std=c++17 -O2 --Werror all-warnings -Xcompiler $(NVCC_HOST_FLAGS) -gencode arch=compute_80,code=sm_80 $< -o $@ -lcublasLt

# Not a test: checks and times the attention kernels' tile variants in one GPU run.
$(BUILD)/bench_attention_variants: test/bench_attention_variants.cu $(TEST_HEADERS) $(COAT_HEADERS)
	@mkdir -p $(BUILD)
	$(NVCC) $(NVCCFLAGS) $< -o $@ $(NVCC_LIBS)

# Not a test: times the gradient reduce-scatter and the parameter all-gather on this launch's ranks,
# one per GPU (scripts/bench_scaling.sh; scripts/predict_scaling.py --calibrate fits them).
$(BUILD)/bench_collectives: test/bench_collectives.cu $(COAT_HEADERS)
	@mkdir -p $(BUILD)
	$(NVCC) $(NVCCFLAGS) $< -o $@ $(NVCC_LIBS)

# The ranks test/test_comm.sh launches: comm_ranks with MPI when this build has it, and
# comm_ranks_single, a build without MPI (its refusal of an MPI launch, the file rendezvous)...
COMM_PROGRAMS := $(BUILD)/comm_ranks $(BUILD)/comm_ranks_single $(BUILD)/zero_ranks
$(BUILD)/comm_ranks: test/comm_ranks.c coat/comm.h coat/rendezvous.h
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS) $(if $(HAVE_MPI),-DUSE_MPI $(MPI_COMPILE)) $< -o $@ $(if $(HAVE_MPI),$(MPI_LINK))
$(BUILD)/comm_ranks_single: test/comm_ranks.c coat/comm.h coat/rendezvous.h
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS) $< -o $@
# ... and zero_ranks, which test/test_zero_gpu.sh launches: coat/collectives.cuh's backends on GPU buffers.
$(BUILD)/zero_ranks: test/zero_ranks.cu $(COAT_HEADERS)
	@mkdir -p $(BUILD)
	$(NVCC) $(NVCCFLAGS) $< -o $@ $(NVCC_LIBS)

# The per-rank checkpoints test/test_scripts.sh and test/test_cli.sh make from one file.
$(BUILD)/checkpoint_split: test/checkpoint_split.c $(COAT_HEADERS)
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS) $< -o $@ -lz
TEST_PROGRAMS := $(COMM_PROGRAMS) $(BUILD)/checkpoint_split $(BUILD)/bench_collectives

HAVE_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
CPU_SCRIPT_TESTS := test/test_cli.sh test/test_shards.sh test/test_scripts.sh test/test_corpus.sh test/test_comm.sh
GPU_SCRIPT_TESTS := test/test_train.sh test/test_crash.sh test/test_zero_gpu.sh test/test_distributed.sh test/test_hf.sh \
                    test/test_pytorch_fp8.sh

# The PyTorch reference's debug state that test_model compares against (needs python3 with
# torch; without it test_model reports the comparison as failed).
$(BUILD)/debug_state.bin: scripts/train_llama.py configs/models/tiny.conf
	@mkdir -p $(BUILD)
	python3 scripts/train_llama.py --debug-state $@ --config configs/models/tiny.conf

# Random attention cases with PyTorch SDPA's answers that test_attention compares against (torch too).
$(BUILD)/attention_sdpa.bin: scripts/attention_sdpa.py
	@mkdir -p $(BUILD)
	python3 scripts/attention_sdpa.py $@

TOKENIZERS := data/tokenizers/llama3/tokenizer.json data/tokenizers/llama2/tokenizer.json
$(TOKENIZERS):
	scripts/fetch_tokenizers.sh

test: all $(CPU_TESTS) $(GPU_TESTS) $(TEST_PROGRAMS) $(TOKENIZERS)
ifeq ($(HAVE_GPU),0)
	@echo "no GPU found (nvidia-smi -L): running the CPU tests only"
	@test/run_tests.sh $(CPU_TESTS) $(CPU_SCRIPT_TESTS)
else
	-@$(MAKE) --no-print-directory $(BUILD)/debug_state.bin $(BUILD)/attention_sdpa.bin
	@test/run_tests.sh $(CPU_TESTS) $(CPU_SCRIPT_TESTS) $(GPU_TESTS) $(GPU_SCRIPT_TESTS)
endif

test-cpu: all $(CPU_TESTS) $(TEST_PROGRAMS) $(TOKENIZERS)
	@test/run_tests.sh $(CPU_TESTS) $(CPU_SCRIPT_TESTS)

test-gpu: all $(GPU_TESTS)
	-@$(MAKE) --no-print-directory $(BUILD)/debug_state.bin $(BUILD)/attention_sdpa.bin
	@test/run_tests.sh $(GPU_TESTS) $(GPU_SCRIPT_TESTS)

bench: all
	scripts/bench.sh

clean:
	rm -rf $(BUILD) train_llama tokenize
