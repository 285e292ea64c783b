# fsdp.c - the one build entry point.
#   make            library, tools, examples and tests (build/)
#   make test       builds, then runs the whole suite (tests/run.sh)
#   make WERROR=1   warnings are errors (CI)
#   make asan | ubsan | tsan   sanitized builds in build-asan/, build-ubsan/, build-tsan/
#   make fuzz       libFuzzer targets in build-fuzz/fuzz/ (clang; not part of all)
#   make install PREFIX=/usr/local   header, libfsdp.{a,so}, fsdp.pc, tools
CC       ?= cc
BUILD    ?= build
PREFIX   ?= /usr/local
ARCH     ?= -march=native
OPT      ?= -O2
WARN     := -Wall -Wextra -Wshadow -Wconversion -Wmissing-prototypes -Wstrict-prototypes \
            -Wno-sign-conversion
ifeq ($(WERROR),1)
WARN     += -Werror
endif
MPI_CFLAGS := $(shell pkg-config --cflags ompi-c 2>/dev/null)
MPI_LIBS   := $(shell pkg-config --libs ompi-c 2>/dev/null || echo -lmpi)
DEP_CFLAGS := $(MPI_CFLAGS) $(shell pkg-config --cflags libcjson 2>/dev/null)
DEP_LIBS   := -ldnnl $(MPI_LIBS) $(shell pkg-config --libs libcjson 2>/dev/null || echo -lcjson) -lz -lm
# -fno-math-errno: sqrt inlines and vectorizes (same values; nothing reads errno after math calls)
CFLAGS   += -std=c11 -D_GNU_SOURCE -fPIC -fopenmp -fno-math-errno $(OPT) $(ARCH) -g $(WARN) $(SAN) \
            -Iinclude -Isrc $(DEP_CFLAGS)
LDFLAGS  += -fopenmp $(SAN)
# objects the sanitized builds link into every executable (make asan: [Note: plugins kept loaded])
SAN_OBJ  ?=

LIB_SRC  := $(wildcard src/core/*.c src/nn/*.c src/comm/*.c src/io/*.c src/optim/*.c src/fsdp/*.c \
                      src/data/*.c src/models/*.c src/fsdp/ckpt/*.c)
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/%.o)
TOOLS    := $(patsubst tools/%.c,$(BUILD)/%,$(wildcard tools/*.c))
TRAIN_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(wildcard tools/train/*.c)) # fsdp-train's other files
TESTS    := $(patsubst tests/%.c,$(BUILD)/tests/%,$(wildcard tests/test_*.c))
EXAMPLES := $(patsubst examples/%.c,$(BUILD)/examples/%,$(wildcard examples/*.c))
BENCHES  := $(patsubst bench/%.c,$(BUILD)/bench/%,$(wildcard bench/*.c))
HDRS     := include/fsdp.h $(wildcard src/*/*.h) $(wildcard tests/*.h) $(wildcard tools/*/*.h) \
            $(wildcard fuzz/*.h fuzz/*.c) # tests replay corpora through the fuzz targets' code
# Each object's headers (and the fuzz sources tests include) come from the compiler (-MMD) in
# a .d file beside it, so a header rebuilds only what includes it; objects also depend on this
# Makefile (its flags), so an older build without .d files is rebuilt once, which writes them.
DEPS     := $(patsubst %.c,$(BUILD)/%.d,$(LIB_SRC) $(wildcard tools/*.c tools/train/*.c tests/test_*.c examples/*.c bench/*.c))

all: $(BUILD)/libfsdp.a $(BUILD)/libfsdp.so $(TOOLS) $(TESTS) $(EXAMPLES) $(BENCHES)

$(BUILD)/%.o: %.c Makefile
	@mkdir -p $(dir $@)
	@echo "CC $<"
	@$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

-include $(wildcard $(DEPS))

$(BUILD)/libfsdp.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/libfsdp.so: $(LIB_OBJ)
	$(CC) -shared -o $@ $^ $(LDFLAGS) $(DEP_LIBS)

$(BUILD)/%: $(BUILD)/tools/%.o $(BUILD)/libfsdp.a $(SAN_OBJ)
	$(CC) -o $@ $< $(SAN_OBJ) $(BUILD)/libfsdp.a $(LDFLAGS) $(DEP_LIBS)

$(BUILD)/fsdp-train: $(BUILD)/tools/fsdp-train.o $(TRAIN_OBJ) $(BUILD)/libfsdp.a $(SAN_OBJ)
	$(CC) -o $@ $(filter %.o,$^) $(BUILD)/libfsdp.a $(LDFLAGS) $(DEP_LIBS)

$(BUILD)/tests/%: $(BUILD)/tests/%.o $(BUILD)/libfsdp.a $(SAN_OBJ)
	$(CC) -o $@ $< $(SAN_OBJ) $(BUILD)/libfsdp.a $(LDFLAGS) $(DEP_LIBS)

$(BUILD)/examples/%: $(BUILD)/examples/%.o $(BUILD)/libfsdp.a $(SAN_OBJ)
	$(CC) -o $@ $< $(SAN_OBJ) $(BUILD)/libfsdp.a $(LDFLAGS) $(DEP_LIBS)

$(BUILD)/bench/%: $(BUILD)/bench/%.o $(BUILD)/libfsdp.a $(SAN_OBJ)
	$(CC) -o $@ $< $(SAN_OBJ) $(BUILD)/libfsdp.a $(LDFLAGS) $(DEP_LIBS)

test: all
	BUILD=$(BUILD) tests/run.sh

asan:
	$(MAKE) BUILD=build-asan SAN="-fsanitize=address,undefined -fno-omit-frame-pointer" OPT=-O1 \
	    SAN_OBJ=build-asan/tests/lsan_keep_plugins.o

ubsan:
	$(MAKE) BUILD=build-ubsan SAN="-fsanitize=undefined -fno-sanitize-recover=undefined" OPT=-O1

# ThreadSanitizer for the threaded parts (shm's progress thread): only what
# tests/tsan.sh runs (the trainer and the collective tests)
tsan:
	$(MAKE) BUILD=build-tsan SAN="-fsanitize=thread -fno-omit-frame-pointer" OPT=-O1 \
	    build-tsan/fsdp-train build-tsan/tests/test_mpi_comm build-tsan/tests/test_mpi_comm_backends

# libFuzzer targets (fuzz/fuzz_*.c) in build-fuzz/fuzz/; needs clang and
# libclang-rt-14-dev (scripts/install-deps.sh --with-fuzz). Not part of `all`;
# scripts/fuzz.sh TARGET SECONDS runs one.
FUZZ_BINS := $(patsubst fuzz/%.c,$(BUILD)/fuzz/%,$(wildcard fuzz/fuzz_*.c))
fuzz:
	$(MAKE) BUILD=build-fuzz CC=clang OPT=-O1 ARCH= \
	    SAN="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -Wno-pass-failed" fuzz-bins
fuzz-bins: $(FUZZ_BINS)
$(BUILD)/fuzz/%: fuzz/%.c fuzz/fuzz.h $(BUILD)/libfsdp.a $(HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -fsanitize=fuzzer -o $@ $< $(BUILD)/libfsdp.a $(LDFLAGS) $(DEP_LIBS)

install: all
	install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/bin
	install -m 644 include/fsdp.h $(DESTDIR)$(PREFIX)/include/
	install -m 644 $(BUILD)/libfsdp.a $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(BUILD)/libfsdp.so $(DESTDIR)$(PREFIX)/lib/
	printf 'prefix=%s\nlibdir=$${prefix}/lib\nincludedir=$${prefix}/include\n\nName: fsdp\nDescription: Fully Sharded Data Parallel training in C\nVersion: 0.1.0\nRequires.private: ompi-c libcjson\nLibs: -L$${libdir} -lfsdp\nLibs.private: -ldnnl -fopenmp -lz -lm\nCflags: -I$${includedir}\n' '$(PREFIX)' > $(DESTDIR)$(PREFIX)/lib/pkgconfig/fsdp.pc
	install -m 755 $(TOOLS) $(DESTDIR)$(PREFIX)/bin/

clean:
	rm -rf build build-asan build-ubsan build-tsan build-fuzz

.PHONY: all test asan ubsan tsan fuzz fuzz-bins install clean
.SECONDARY:
