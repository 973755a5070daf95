# moe - build the runtime objects, the example programs and the tests into build/.
# Override anything on the command line: make CC=clang CFLAGS="-O3 -std=c11".

# as many jobs as processors unless told otherwise (make -j1: one at a time)
ifeq ($(filter -j%,$(MAKEFLAGS)),)
MAKEFLAGS += -j$(shell nproc 2>/dev/null || echo 2)
endif

CC ?= cc
CFLAGS ?= -O2 -std=c11 -Wall -Wextra -pedantic
LDLIBS = -lm -lpthread
BUILD ?= build
# OpenMP when the compiler has it; a plain serial build otherwise (OPENMP= to turn it off)
OPENMP ?= $(shell printf 'int main(void){return 0;}' | $(CC) -fopenmp -x c - -o /dev/null 2>/dev/null && echo -fopenmp)
ALL_CFLAGS = $(CFLAGS) $(OPENMP) $(EXTRA_CFLAGS)

LIB = $(BUILD)/moe.o $(BUILD)/quant.o
# the example programs: examples/NAME.c becomes $(BUILD)/moe-NAME
EXAMPLE_NAMES = logits cli perplexity convert bench plan tokenize batch cachesim server
EXAMPLES = $(EXAMPLE_NAMES:%=$(BUILD)/moe-%)
# the test suite: test/main.c (the runner), test/util.c (shared helpers), one file per area
TEST_SRC = test/main.c test/util.c test/kernels.c test/gguf.c test/model.c test/cache.c test/text.c test/programs.c test/faults.c test/hostile.c test/server.c
TEST_OBJ = $(TEST_SRC:test/%.c=$(BUILD)/test/%.o)
TESTS = $(BUILD)/moe-test
# every compile writes the headers it read (-MMD) into a .d file beside its output, read below
DEPFLAGS = -MMD -MP

.PHONY: FORCE all examples lib install uninstall test test-scalar test-avxvnni-evex test-neon asan tsan bench fuzz clean help

# where make bench keeps its random benchmark-shape models (about 9 GB; made once)
BENCH_MODELS ?= bench/models
BENCH_ARGS ?= -t 1,2 --depth 0,4096 --prefill 512

# all: the library objects, every example program and the test suite
all: $(LIB) $(EXAMPLES) $(BUILD)/simple $(TESTS)

# examples: the programs in examples/ (moe-logits, moe-cli, moe-perplexity, moe-convert, moe-bench, moe-plan, moe-tokenize, moe-batch, moe-cachesim, moe-server)
examples: $(EXAMPLES)

$(BUILD)/%.o: %.c | $(BUILD)
	$(CC) $(ALL_CFLAGS) $(DEPFLAGS) -c $< -o $@

$(BUILD)/moe-%: examples/%.c $(LIB)
	$(CC) $(ALL_CFLAGS) $(DEPFLAGS) $< $(LIB) $(LDLIBS) -o $@

# moe-server serves examples/chat.html at /, compiled in as the C array chat_html (od is POSIX)
$(BUILD)/chat_html.h: examples/chat.html | $(BUILD)
	{ printf 'static const unsigned char chat_html[] = {\n'; od -An -v -tx1 $< | sed 's/ *\([0-9a-f][0-9a-f]\)/0x\1,/g'; printf '};\n'; } > $@.tmp
	mv $@.tmp $@

$(BUILD)/moe-server: examples/server.c $(BUILD)/chat_html.h $(LIB)
	$(CC) $(ALL_CFLAGS) -I$(BUILD) $(DEPFLAGS) $< $(LIB) $(LDLIBS) -o $@

# examples/simple.c, the smallest program (README's embedding example), as build/simple
$(BUILD)/simple: examples/simple.c $(LIB)
	$(CC) $(ALL_CFLAGS) -I. $(DEPFLAGS) $< $(LIB) $(LDLIBS) -o $@

# the library to link against: libmoe.a, and libmoe.so (soname libmoe.so.$(SOVERSION)) from
# position-independent objects in $(BUILD)/pic/
SOVERSION = 0
VERSION = 0.1.0
$(BUILD)/libmoe.a: $(LIB)
	rm -f $@
	ar rcs $@ $(LIB)

$(BUILD)/pic/%.o: %.c | $(BUILD)
	@mkdir -p $(BUILD)/pic
	$(CC) $(ALL_CFLAGS) -fPIC $(DEPFLAGS) -c $< -o $@

$(BUILD)/libmoe.so.$(VERSION): $(BUILD)/pic/moe.o $(BUILD)/pic/quant.o
	$(CC) $(ALL_CFLAGS) -shared -Wl,-soname,libmoe.so.$(SOVERSION) $^ $(LDLIBS) -o $@

# pkg-config's description of the installed library (written anew each time: PREFIX may change)
$(BUILD)/moe.pc: FORCE | $(BUILD)
	printf '%s\n' 'prefix=$(PREFIX)' 'includedir=$${prefix}/include' 'libdir=$${prefix}/lib' '' 'Name: moe' \
	  'Description: CPU inference for sparse Mixture-of-Experts models (Kimi Linear, Kimi K3)' 'Version: $(VERSION)' \
	  'Cflags: -I$${includedir}' 'Libs: -L$${libdir} -lmoe' 'Libs.private: $(OPENMP) $(LDLIBS)' > $@

# lib: libmoe.a, libmoe.so and moe.pc in $(BUILD)/
lib: $(BUILD)/libmoe.a $(BUILD)/libmoe.so.$(VERSION) $(BUILD)/moe.pc

# install: the header, the libraries, moe.pc and the programs under $(DESTDIR)$(PREFIX) (default /usr/local)
PREFIX ?= /usr/local
install: lib $(EXAMPLES)
	install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/bin
	install -m 644 moe.h $(DESTDIR)$(PREFIX)/include/moe.h
	install -m 644 $(BUILD)/libmoe.a $(DESTDIR)$(PREFIX)/lib/libmoe.a
	install -m 755 $(BUILD)/libmoe.so.$(VERSION) $(DESTDIR)$(PREFIX)/lib/libmoe.so.$(VERSION)
	ln -sf libmoe.so.$(VERSION) $(DESTDIR)$(PREFIX)/lib/libmoe.so.$(SOVERSION)
	ln -sf libmoe.so.$(SOVERSION) $(DESTDIR)$(PREFIX)/lib/libmoe.so
	install -m 644 $(BUILD)/moe.pc $(DESTDIR)$(PREFIX)/lib/pkgconfig/moe.pc
	install -m 755 $(EXAMPLES) $(DESTDIR)$(PREFIX)/bin/

# uninstall: remove what install put there
uninstall:
	rm -f $(DESTDIR)$(PREFIX)/include/moe.h $(DESTDIR)$(PREFIX)/lib/libmoe.a $(DESTDIR)$(PREFIX)/lib/libmoe.so \
	  $(DESTDIR)$(PREFIX)/lib/libmoe.so.$(SOVERSION) $(DESTDIR)$(PREFIX)/lib/libmoe.so.$(VERSION) $(DESTDIR)$(PREFIX)/lib/pkgconfig/moe.pc \
	  $(EXAMPLE_NAMES:%=$(DESTDIR)$(PREFIX)/bin/moe-%)

$(BUILD)/test/%.o: test/%.c | $(BUILD)
	@mkdir -p $(BUILD)/test
	$(CC) $(ALL_CFLAGS) $(DEPFLAGS) -c $< -o $@

$(BUILD)/moe-test: $(TEST_OBJ) $(LIB)
	$(CC) $(ALL_CFLAGS) $(TEST_OBJ) $(LIB) $(LDLIBS) -o $@

-include $(wildcard $(BUILD)/*.d $(BUILD)/test/*.d $(BUILD)/pic/*.d)

$(BUILD):
	mkdir -p $(BUILD)

# test: build everything and run the whole suite (unit, golden, bad input); prints N passed, N failed
# (TEST_ARGS: run only the tests or areas named; build/moe-test --list shows them)
test: all
	$(RUN) ./$(BUILD)/moe-test $(TEST_ARGS)

# test-scalar: the suite built without any SIMD code (-DMOE_NO_SIMD), in build-scalar/
test-scalar:
	$(MAKE) --no-print-directory BUILD=build-scalar EXTRA_CFLAGS=-DMOE_NO_SIMD test

# test-avxvnni-evex: the suite with the AVX-VNNI kernels in the EVEX encoding, in build-avxvnni-evex/
# (-DMOE_AVXVNNI_AS_EVEX: offered on AVX-512 VNNI CPUs, so their logic is checked on a machine
# without AVX-VNNI, such as a Zen 4; qemu lacks it too)
test-avxvnni-evex:
	$(MAKE) --no-print-directory BUILD=build-avxvnni-evex EXTRA_CFLAGS=-DMOE_AVXVNNI_AS_EVEX test

# the tests test-neon also runs built with OpenMP (OpenMP threads under emulation would slow the
# whole suite for little)
NEON_THREAD_TESTS = model.step_team cache.concurrent_teams model.golden_threads_scalar kernels.info_kernels

# test-neon: the suite cross-built for AArch64 (NEON, dot product) and run under qemu-user (the team's tests with OpenMP first)
test-neon:
	$(MAKE) --no-print-directory BUILD=build-neon-omp CC=aarch64-linux-gnu-gcc RUN="env MOE_TEST_RUNNER='$(QEMU_AARCH64)' $(QEMU_AARCH64)" TEST_ARGS="$(NEON_THREAD_TESTS)" test
	$(MAKE) --no-print-directory BUILD=build-neon CC=aarch64-linux-gnu-gcc OPENMP= RUN="env MOE_TEST_RUNNER='$(QEMU_AARCH64)' $(QEMU_AARCH64)" test

QEMU_AARCH64 ?= qemu-aarch64 -L /usr/aarch64-linux-gnu -cpu max

# asan: the suite under AddressSanitizer + UndefinedBehaviorSanitizer, with OpenMP and without
# (build-asan-omp/: the step's team of threads; build-asan/: the serial paths)
ASAN_FLAGS = EXTRA_CFLAGS="-g -O1 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" LDLIBS="-lm -lpthread -fsanitize=address,undefined"
asan:
	$(MAKE) --no-print-directory BUILD=build-asan-omp $(ASAN_FLAGS) test
	$(MAKE) --no-print-directory BUILD=build-asan OPENMP= $(ASAN_FLAGS) test

# bench: decode/prefill speed as fractions of this machine's measured limits (makes the models first)
bench: all
	@mkdir -p $(BENCH_MODELS)
	@for t in q4_0 q8_0; do test -f $(BENCH_MODELS)/kimi-linear-bench-$$t.gguf || \
	  ./$(BUILD)/moe-convert --random bench/shapes/kimi-linear-bench.json $(BENCH_MODELS)/kimi-linear-bench-$$t.gguf --dense $$t || exit 1; done
	./$(BUILD)/moe-bench -m $(BENCH_MODELS)/kimi-linear-bench-q4_0.gguf -m $(BENCH_MODELS)/kimi-linear-bench-q8_0.gguf $(BENCH_ARGS)

# tsan: the expert-cache, concurrency and moe-server tests under ThreadSanitizer (clang), in build-tsan/
tsan: $(BUILD)/chat_html.h $(BUILD)/moe-cli $(BUILD)/moe-batch
	@mkdir -p build-tsan
	$(FUZZ_CC) -g -O1 -fsanitize=thread -std=c11 $(TEST_SRC) moe.c quant.c -lm -lpthread -o build-tsan/moe-test
	$(FUZZ_CC) -g -O1 -fsanitize=thread -std=c11 -I$(BUILD) examples/server.c moe.c quant.c -lm -lpthread -o build-tsan/moe-server
	cp $(BUILD)/moe-cli $(BUILD)/moe-batch build-tsan/
	./build-tsan/moe-test cache.equivalence faults.cache_reads cache.prefetch cache.concurrent_sessions cache.dense_streaming \
	  server.endpoints server.stream server.concurrent server.disconnect server.prefix_cache server.hostile

# fuzz: each parser (json safetensors gguf config ranks tokenize chat batch http) under libFuzzer + ASan/UBSan for FUZZ_SECONDS
fuzz:
	@mkdir -p build-fuzz
	@set -e; for t in $(FUZZ_TARGETS); do \
	  T=$$(echo $$t | tr a-z A-Z); \
	  $(FUZZ_CC) -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -DFUZZ_$$T \
	    test/fuzz/fuzz.c moe.c quant.c -lm -o build-fuzz/fuzz-$$t; \
	  mkdir -p build-fuzz/corpus-$$t; \
	  ./build-fuzz/fuzz-$$t -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -rss_limit_mb=2048 \
	    -artifact_prefix=build-fuzz/crash-$$t- build-fuzz/corpus-$$t test/fuzz/corpus/$$t \
	    > build-fuzz/log-$$t.txt 2>&1 || { tail -60 build-fuzz/log-$$t.txt; echo "fuzz-$$t: FAILED (log build-fuzz/log-$$t.txt)"; exit 1; }; \
	  echo "fuzz-$$t: $$(grep -E '^Done' build-fuzz/log-$$t.txt), no crash"; \
	done

FUZZ_CC ?= clang
FUZZ_SECONDS ?= 60
FUZZ_TARGETS = json safetensors gguf config ranks tokenize chat batch http

# clean: remove every build folder
clean:
	rm -rf build build-scalar build-asan build-asan-omp build-avxvnni-evex build-neon build-neon-omp build-fuzz build-tsan

# help: list the targets (every one has a "# NAME: what it does" line above it)
help:
	@grep -E '^# [a-z-]+: ' Makefile | sed 's/^# /  /'
