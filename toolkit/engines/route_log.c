// moetrace-route-log: llama.cpp's MoE routing, per generated token, as moetrace's router trace
// (JSON Lines: {"step", "layer", "experts" in rank order, "request"}, README "Router trace format").
//
// Built by scripts/engine-setup.sh against the unpacked libllama-dev and run through sid's loader
// (moetrace.engines.llamacpp.Engine.route_log). It loads the model as llama.cpp does (the load
// mode given, repacking as asked), decodes the prompt (its records carry "phase": "prefill", which
// the trace parser skips), then generates N tokens greedily, one decode each, and writes each
// decode's routing: the graph callback asks only for the `ffn_moe_topk-<L>` nodes, one per MoE
// layer, reads the selected experts (a view of the argsort: rows strided by nb[1]) in the
// router's rank order. No warm-up pass (a warm-up routes every expert). Each record also has the
// decode's start (CLOCK_MONOTONIC ns, `t_ns`) and its duration (`decode_ns`). An end-of-generation
// token does not stop it (the same number of tokens every run), unless --stop-at-eog.
//
// --advise normal|random|sequential: after the load, madvise every mapping of the model file
// (found in /proc/self/maps) so: random turns the fault path's readahead off (one page per
// fault), as an engine with MADV_RANDOM would.
// --step READY_FD,GO_FD: before the model loads write "load\n" to READY_FD, and before each pass
// (the prompt's, then one per token) "pass N\n", each time waiting for a byte on GO_FD (the
// driver, moetrace.engines.llamacpp.log_routing, moves the logger into a cgroup, empties the
// cache and moves the recorder's epoch in between); "end\n" after the last.
//
// usage: moetrace-route-log -m MODEL -o OUT.jsonl [-p PROMPT] [-n TOKENS] [-t THREADS]
//                           [-l auto|none|mmap|mlock|mmap+mlock|dio] [-r REQUEST] [--no-repack] [--stop-at-eog]
//                           [--advise normal|random|sequential] [--step READY_FD,GO_FD]
#include <ggml-backend.h>
#include <ggml.h>
#include <llama.h>
#include <getopt.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_LAYERS 1024
#define MAX_K 256

struct route_log {
    FILE *out;
    const char *request;
    int n_layer, k, seen[MAX_LAYERS];
    int32_t sel[MAX_LAYERS][MAX_K];
};

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

// "ffn_moe_topk-<L>" -> L, anything else -> -1
static int topk_layer(const char *name) {
    static const char prefix[] = "ffn_moe_topk-";
    if (strncmp(name, prefix, sizeof prefix - 1) != 0)
        return -1;
    char *end;
    long l = strtol(name + sizeof prefix - 1, &end, 10);
    return (*end == '\0' && l >= 0 && l < MAX_LAYERS) ? (int)l : -1;
}

static bool on_eval(struct ggml_tensor *t, bool ask, void *user) {
    struct route_log *lg = user;
    int layer = topk_layer(t->name);
    if (ask)
        return layer >= 0;  // only the top-k nodes: every other node stays in its batch
    if (layer < 0 || t->type != GGML_TYPE_I32)
        return true;
    int64_t k = t->ne[0], rows = t->ne[1];
    uint8_t *copy = NULL;
    const uint8_t *base = t->data;
    if (!t->buffer || !ggml_backend_buffer_is_host(t->buffer)) {
        copy = malloc(ggml_nbytes(t));
        ggml_backend_tensor_get(t, copy, 0, ggml_nbytes(t));
        base = copy;
    }
    const int32_t *row = (const int32_t *)(base + (rows - 1) * t->nb[1]);  // the last position's row
    for (int64_t i = 0; i < k && i < MAX_K; i++)
        lg->sel[layer][i] = row[i];
    lg->k = k < MAX_K ? (int)k : MAX_K;
    lg->seen[layer] = 1;
    free(copy);
    return true;
}

static void write_step(struct route_log *lg, int step, int prefill, long long t0, long long dt) {
    for (int l = 0; l < lg->n_layer && l < MAX_LAYERS; l++) {
        if (!lg->seen[l])
            continue;
        fprintf(lg->out, "{\"step\": %d, \"layer\": %d, \"experts\": [", step, l);
        for (int i = 0; i < lg->k; i++)
            fprintf(lg->out, "%s%d", i ? ", " : "", lg->sel[l][i]);
        fprintf(lg->out, "], \"request\": \"%s\", \"t_ns\": %lld, \"decode_ns\": %lld%s}\n", lg->request, t0, dt,
                prefill ? ", \"phase\": \"prefill\"" : "");
    }
    memset(lg->seen, 0, sizeof lg->seen);
}

static void warnings_only(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level >= GGML_LOG_LEVEL_WARN)
        fputs(text, stderr);
}

static bool silent_progress(float progress, void *user) {
    (void)progress;
    (void)user;
    return true;  // no dots on stderr: its last line is the summary
}

static int usage(const char *argv0) {
    fprintf(stderr, "usage: %s -m MODEL -o OUT.jsonl [-p PROMPT] [-n TOKENS] [-t THREADS] "
            "[-l auto|none|mmap|mlock|mmap+mlock|dio] [-r REQUEST] [--no-repack] [--stop-at-eog] "
            "[--advise normal|random|sequential] [--step READY_FD,GO_FD]\n", argv0);
    return 2;
}

// madvise(advice) on every mapping of `path` in this process; the mappings advised, -1 on error
static int advise_model(const char *path, int advice) {
    char real[4096], line[8192];
    if (!realpath(path, real))
        return -1;
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f)
        return -1;
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        int off = 0;
        if (sscanf(line, "%lx-%lx %*s %*s %*s %*s %n", &lo, &hi, &off) < 2 || !off)
            continue;
        char *name = line + off;
        name[strcspn(name, "\n")] = '\0';
        if (strcmp(name, real) != 0)
            continue;
        if (madvise((void *)lo, hi - lo, advice) != 0) {
            n = -1;
            break;
        }
        n++;
    }
    fclose(f);
    return n;
}

// --step: tell the driver which pass comes and wait for its go; 0 when there is no driver
static int step_wait(int ready, int go, const char *what) {
    if (ready < 0)
        return 0;
    char b;
    if (write(ready, what, strlen(what)) < 0 || read(go, &b, 1) != 1)
        return -1;
    return 0;
}

int main(int argc, char **argv) {
    const char *model_path = NULL, *out_path = NULL, *prompt = "the a b", *mode = "mmap", *request = "r0";
    const char *advise = NULL;
    int n_tokens = 64, threads = 1, repack = 1, stop_at_eog = 0, ready = -1, go = -1, opt;
    static struct option longs[] = {{"no-repack", no_argument, 0, 'R'}, {"stop-at-eog", no_argument, 0, 'E'},
                                    {"advise", required_argument, 0, 'A'}, {"step", required_argument, 0, 'S'}, {0}};
    while ((opt = getopt_long(argc, argv, "m:o:p:n:t:l:r:", longs, NULL)) != -1) {
        switch (opt) {
        case 'm': model_path = optarg; break;
        case 'o': out_path = optarg; break;
        case 'p': prompt = optarg; break;
        case 'n': n_tokens = atoi(optarg); break;
        case 't': threads = atoi(optarg); break;
        case 'l': mode = optarg; break;
        case 'r': request = optarg; break;
        case 'R': repack = 0; break;
        case 'E': stop_at_eog = 1; break;
        case 'A': advise = optarg; break;
        case 'S':
            if (sscanf(optarg, "%d,%d", &ready, &go) != 2 || ready < 0 || go < 0)
                return usage(argv[0]);
            break;
        default: return usage(argv[0]);
        }
    }
    if (!model_path || !out_path || n_tokens < 1 || threads < 1)
        return usage(argv[0]);
    struct route_log lg = {.request = request};
    if (!(lg.out = fopen(out_path, "w"))) {
        perror(out_path);
        return 1;
    }
    llama_log_set(warnings_only, NULL);
    // MOETRACE_GGML_BACKENDS: the directory of Debian's CPU backend variants; ggml scores them on
    // the CPU this runs on (a lab guest's QEMU CPU lacks the host's AVX-512: the set-up's choice,
    // GGML_BACKEND_PATH, does not load there). Without it, GGML_BACKEND_PATH names the backend.
    const char *variants = getenv("MOETRACE_GGML_BACKENDS");
    if (variants && *variants) {
        unsetenv("GGML_BACKEND_PATH");  // else ggml loads it too, beside its own choice
        ggml_backend_load_all_from_path(variants);
    } else {
        ggml_backend_load_all();
    }
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.load_mode = llama_load_mode_from_str(mode);
    mp.use_extra_bufts = repack;
    mp.progress_callback = silent_progress;
    if (step_wait(ready, go, "load\n") != 0) {
        fprintf(stderr, "--step: the driver is gone before the load\n");
        return 1;
    }
    struct llama_model *model = llama_model_load_from_file(model_path, mp);
    if (!model) {
        fprintf(stderr, "%s: the model did not load\n", model_path);
        return 1;
    }
    if (advise) {
        int a = !strcmp(advise, "random") ? MADV_RANDOM : !strcmp(advise, "sequential") ? MADV_SEQUENTIAL
              : !strcmp(advise, "normal") ? MADV_NORMAL : -1;
        int n = a < 0 ? -1 : advise_model(model_path, a);
        if (n <= 0) {
            fprintf(stderr, "--advise %s: %s\n", advise, a < 0 ? "not normal, random or sequential"
                    : n == 0 ? "the model is not mapped (load mode without mmap)" : "madvise failed");
            return 1;
        }
    }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    lg.n_layer = llama_model_n_layer(model);
    int n_prompt = -llama_tokenize(vocab, prompt, (int)strlen(prompt), NULL, 0, true, true);
    llama_token *toks = malloc(sizeof(llama_token) * (n_prompt > 0 ? n_prompt : 1));
    if (n_prompt < 1 || llama_tokenize(vocab, prompt, (int)strlen(prompt), toks, n_prompt, true, true) < 0) {
        fprintf(stderr, "the prompt does not tokenize\n");
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_prompt + n_tokens + 8;
    cp.n_batch = cp.n_ubatch = n_prompt;
    cp.n_threads = cp.n_threads_batch = threads;
    cp.no_perf = false;
    cp.cb_eval = on_eval;
    cp.cb_eval_user_data = &lg;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "no context\n");
        return 1;
    }
    struct llama_sampler *smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(smpl, llama_sampler_init_greedy());
    struct llama_batch batch = llama_batch_get_one(toks, n_prompt);
    llama_token tok;
    int step = 0, rc = 0;
    for (int pass = 0; pass <= n_tokens; pass++) {  // pass 0: the prompt; then one per token
        char what[32];
        snprintf(what, sizeof what, "pass %d\n", pass);
        if (step_wait(ready, go, what) != 0) {
            fprintf(stderr, "--step: the driver is gone before pass %d\n", pass);
            rc = 1;
            break;
        }
        long long t0 = now_ns();
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "decode %d failed\n", pass);
            rc = 1;
            break;
        }
        write_step(&lg, pass ? step++ : 0, pass == 0, t0, now_ns() - t0);
        if (pass == n_tokens)
            break;
        tok = llama_sampler_sample(smpl, ctx, -1);
        if (stop_at_eog && llama_vocab_is_eog(vocab, tok))
            break;
        batch = llama_batch_get_one(&tok, 1);
    }
    fflush(lg.out);
    if (ready >= 0 && write(ready, "end\n", 4) < 0)
        rc = 1;
    struct llama_perf_context_data pd = llama_perf_context(ctx);
    fprintf(stderr, "{\"tokens\": %d, \"prompt_tokens\": %d, \"eval_ms\": %.3f, \"n_eval\": %d, \"layers\": %d, "
            "\"load_mode\": \"%s\"}\n", step, n_prompt, pd.t_eval_ms, pd.n_eval, lg.n_layer,
            llama_load_mode_name(mp.load_mode));
    llama_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    free(toks);
    llama_backend_free();
    if (fclose(lg.out) != 0)
        rc = 1;
    return rc;
}
