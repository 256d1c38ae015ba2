// oneDNN's 2-D convolutions (forward; backward-data and backward-weights in one call) as XLA FFI handlers on
// CPU, for NHWC activations and HWIO kernels in f32; and its batched matmul (the GPT's attention products, f32).
// Built and loaded by jaxtrain/kernels/onednn.py.
//
// The primitives take oneDNN's own blocked layouts (format_tag::any: its jit:avx512_core / avx2 kernels; the
// plain NHWC layouts make oneDNN 2.6 pick slower gemm kernels), reached by reorders from and to XLA's buffers.
// Each call brings its own scratchpad: XLA runs independent custom calls (and each virtual device's) at the same
// time, and a library-managed scratchpad is shared between concurrent executions (a wrong dw was seen).
#include <exception>
#include <stdexcept>
#include <mutex>
#include <string>
#include <unordered_map>

#include <omp.h>
#include <oneapi/dnnl/dnnl.hpp>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace dnnl;
using tag = memory::format_tag;
using dt = memory::data_type;

static engine& eng() {
  static engine e(engine::kind::cpu, 0);
  return e;
}

// A convolution's shapes in oneDNN's dims order: src {N,C,H,W}, weights {O,I,KH,KW}, dst {N,O,Ho,Wo}.
struct Geo {
  memory::dims src, wei, dst, strides, pl, pr;
  bool always_blocked;  // JAXTRAIN_ONEDNN_BLOCKED=1 (jaxtrain.settings), an attribute of every call
  std::string key(char kind) const {
    std::string s(1, kind);
    if (always_blocked) s += "B";
    for (auto* v : {&src, &wei, &dst, &strides, &pl, &pr}) {
      for (auto d : *v) s += "," + std::to_string(d);
      s += ";";
    }
    return s;
  }
  memory::desc s(tag t) const { return {src, dt::f32, t}; }
  memory::desc w(tag t) const { return {wei, dt::f32, t}; }
  memory::desc d(tag t) const { return {dst, dt::f32, t}; }
};

// x: [N,H,W,C], w: [KH,KW,I,O], y: [N,Ho,Wo,O] (XLA's dimensions).
static Geo geo(ffi::Span<const int64_t> x, ffi::Span<const int64_t> w, ffi::Span<const int64_t> y, int64_t sh,
               int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr, int64_t always_blocked) {
  return Geo{{x[0], x[3], x[1], x[2]}, {w[3], w[2], w[0], w[1]}, {y[0], y[3], y[1], y[2]}, {sh, sw}, {pt, pl},
             {pb, pr}, always_blocked != 0};
}

static primitive_attr attr() {
  primitive_attr a;
  a.set_scratchpad_mode(scratchpad_mode::user);
  return a;
}

// The three primitive descriptors, in oneDNN 3's API (the pip wheel's) or 2's (Debian 12's libdnnl-dev), for the
// activations' layout `t`: XLA's NHWC (no reorders), or `any` (oneDNN's blocked layouts, reached by reorders).
#if DNNL_VERSION_MAJOR >= 3
static convolution_forward::primitive_desc fwd_pd(const Geo& g, tag t) {
  return {eng(), prop_kind::forward_training, algorithm::convolution_direct, g.s(t), g.w(tag::any), g.d(t),
          g.strides, g.pl, g.pr, attr()};
}
static convolution_backward_data::primitive_desc data_pd(const Geo& g, tag t) {
  return {eng(), algorithm::convolution_direct, g.s(t), g.w(tag::any), g.d(t), g.strides, g.pl, g.pr,
          fwd_pd(g, t), attr()};
}
static convolution_backward_weights::primitive_desc weights_pd(const Geo& g, tag t) {
  return {eng(), algorithm::convolution_direct, g.s(t), g.w(tag::any), g.d(t), g.strides, g.pl, g.pr,
          fwd_pd(g, t), attr()};
}
#else
static convolution_forward::primitive_desc fwd_pd(const Geo& g, tag t) {
  auto desc = convolution_forward::desc(prop_kind::forward_training, algorithm::convolution_direct, g.s(t),
                                        g.w(tag::any), g.d(t), g.strides, g.pl, g.pr);
  return convolution_forward::primitive_desc(desc, attr(), eng());
}
static convolution_backward_data::primitive_desc data_pd(const Geo& g, tag t) {
  auto desc = convolution_backward_data::desc(algorithm::convolution_direct, g.s(t), g.w(tag::any), g.d(t),
                                              g.strides, g.pl, g.pr);
  return convolution_backward_data::primitive_desc(desc, attr(), eng(), fwd_pd(g, t));
}
static convolution_backward_weights::primitive_desc weights_pd(const Geo& g, tag t) {
  auto desc = convolution_backward_weights::desc(algorithm::convolution_direct, g.s(t), g.w(tag::any), g.d(t),
                                                 g.strides, g.pl, g.pr);
  return convolution_backward_weights::primitive_desc(desc, attr(), eng(), fwd_pd(g, t));
}
#endif

// The backward primitives take NHWC where oneDNN has a direct kernel for it (oneDNN 3's brgconv / jit on
// AVX-512): no reorders of dy, dx or x, at the blocked kernels' speed. The forward keeps the blocked layouts:
// oneDNN 3.2's NHWC forwards ran ~45 ms per ResNet-18 step slower than its blocked ones, more than the
// reorders of x and y cost (docs/performance.md, "oneDNN convolutions"). Blocked, too, where NHWC would get a
// gemm or reference kernel (oneDNN 2.6). g.always_blocked: the blocked layouts always (to measure).
template <class PD>
static PD pick(PD (*make)(const Geo&, tag), const Geo& g) {
  if (!g.always_blocked) {
    try {
      PD pd = make(g, tag::nhwc);
      std::string impl = pd.impl_info_str();
      if (impl.find("gemm") == std::string::npos && impl.find("ref") == std::string::npos) return pd;
    } catch (const error&) {
    }
  }
  return make(g, tag::any);
}

// A primitive and the layouts it wants for its three tensors (in the handler's argument order).
struct Entry {
  primitive p;
  memory::desc a, b, c, scratch;
};
static std::mutex mu;
static std::unordered_map<std::string, Entry> cache;

template <class F>
static Entry& cached(const std::string& k, F make) {
  std::lock_guard<std::mutex> l(mu);
  auto key = k + "@" + std::to_string(omp_get_max_threads());  // made for the threads it runs with
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, make()).first;
  return it->second;
}

static Entry& fwd_entry(const Geo& g) {
  return cached(g.key('f'), [&] {
    auto pd = fwd_pd(g, tag::any);
    return Entry{convolution_forward(pd), pd.src_desc(), pd.weights_desc(), pd.dst_desc(), pd.scratchpad_desc()};
  });
}

static Entry& data_entry(const Geo& g) {
  return cached(g.key('d'), [&] {
    auto pd = pick(data_pd, g);
    return Entry{convolution_backward_data(pd), pd.diff_src_desc(), pd.weights_desc(), pd.diff_dst_desc(),
                 pd.scratchpad_desc()};
  });
}

static Entry& weights_entry(const Geo& g) {
  return cached(g.key('w'), [&] {
    auto pd = pick(weights_pd, g);
    return Entry{convolution_backward_weights(pd), pd.src_desc(), pd.diff_weights_desc(), pd.diff_dst_desc(),
                 pd.scratchpad_desc()};
  });
}

// An input in the primitive's layout (a reorder when it differs); an output's buffer in it; the way back.
static memory in(stream& st, const memory::desc& want, memory user) {
  if (want == user.get_desc()) return user;
  memory m(want, eng());
  reorder(user, m).execute(st, user, m);
  return m;
}
static memory out(const memory::desc& want, const memory& user) {
  return want == user.get_desc() ? user : memory(want, eng());
}
static void back(stream& st, memory m, memory user) {
  if (m.get_data_handle() != user.get_data_handle()) reorder(m, user).execute(st, m, user);
}

// oneDNN reports failures by exceptions: an FFI error instead (a Python exception, not an abort). `threads`:
// the OpenMP threads of this call (the cores over the virtual devices that run at once: 2 devices on 2 cores ran
// 4 threads on 2 cores otherwise), set on the calling thread, XLA's, before its primitives are made and run.
template <class F>
static ffi::Error guarded(int64_t threads, F body, const char* what = "oneDNN convolution") {
  try {
    omp_set_num_threads((int)threads);
    body();
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string(what) + ": " + e.what());
  }
}

// The forward primitive on x1 (in its layout already): y (NHWC) = conv(x1, w (HWIO)).
static void forward(Entry& e, stream& st, const Geo& g, const memory& x1, float* w, float* y) {
  memory mw(g.w(tag::hwio), eng(), w), my(g.d(tag::nhwc), eng(), y);
  auto w1 = in(st, e.b, mw), y1 = out(e.c, my);
  e.p.execute(st, {{DNNL_ARG_SCRATCHPAD, memory(e.scratch, eng())},
                   {DNNL_ARG_SRC, x1},
                   {DNNL_ARG_WEIGHTS, w1},
                   {DNNL_ARG_DST, y1}});
  back(st, y1, my);
  st.wait();
}

// y = conv(x, w)
static ffi::Error Fwd(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y, int64_t sh,
                      int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr, int64_t threads,
                      int64_t always_blocked) {
  return guarded(threads, [&] {
    Geo g = geo(x.dimensions(), w.dimensions(), y->dimensions(), sh, sw, pt, pb, pl, pr, always_blocked);
    auto& e = fwd_entry(g);
    stream st(eng());
    forward(e, st, g, in(st, e.a, memory(g.s(tag::nhwc), eng(), x.typed_data())), w.typed_data(), y->typed_data());
  });
}

// Floats per example of the backward-weights primitive's input layout, where that layout keeps each example
// contiguous (the batch outermost, not blocked); else -1. The forward can then save its input in that layout
// (a [N, floats] residual that splits along the batch like the activations), sparing the backward a reorder.
static int64_t saved_per_example(const memory::desc& md, int64_t n) {
#if DNNL_VERSION_MAJOR >= 3
  if (md.get_format_kind() != memory::format_kind::blocked || n <= 0) return -1;
  for (auto i : md.get_inner_idxs())
    if (i == 0) return -1;
  int64_t stride0 = md.get_strides()[0];
#else
  const auto& d = md.data;
  if (d.format_kind != dnnl_blocked || n <= 0) return -1;
  for (int i = 0; i < d.format_desc.blocking.inner_nblks; ++i)
    if (d.format_desc.blocking.inner_idxs[i] == 0) return -1;
  int64_t stride0 = d.format_desc.blocking.strides[0];
#endif
  int64_t per = (int64_t)(md.get_size() / sizeof(float)) / n;
  return stride0 == per && per * n * (int64_t)sizeof(float) == (int64_t)md.get_size() ? per : -1;
}

extern "C" int64_t JaxtrainDnnlSavedFloats(int64_t n, int64_t h, int64_t w, int64_t c, int64_t kh, int64_t kw,
                                           int64_t o, int64_t ho, int64_t wo, int64_t sh, int64_t sw, int64_t pt,
                                           int64_t pb, int64_t pl, int64_t pr, int64_t threads,
                                           int64_t always_blocked) {
  int before = omp_get_max_threads();  // the caller's (Python's) thread keeps its own setting
  int64_t floats = -1;
  try {
    omp_set_num_threads((int)threads);
    Geo g{{n, c, h, w}, {o, c, kh, kw}, {n, o, ho, wo}, {sh, sw}, {pt, pl}, {pb, pr}, always_blocked != 0};
    auto& e = weights_entry(g);
    floats = e.a == g.s(tag::nhwc) ? -1 : saved_per_example(e.a, n);  // NHWC: x itself serves, uncopied
  } catch (const std::exception&) {
  }
  omp_set_num_threads(before);
  return floats;
}

// y = conv(x, w), and x in the backward-weights layout (saved: [N, JaxtrainDnnlSavedFloats]).
static ffi::Error FwdSave(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y,
                          ffi::ResultBuffer<ffi::F32> saved, int64_t sh, int64_t sw, int64_t pt, int64_t pb,
                          int64_t pl, int64_t pr, int64_t threads, int64_t always_blocked) {
  return guarded(threads, [&] {
    Geo g = geo(x.dimensions(), w.dimensions(), y->dimensions(), sh, sw, pt, pb, pl, pr, always_blocked);
    auto& e = fwd_entry(g);
    auto& ew = weights_entry(g);
    auto dims = saved->dimensions();
    if (dims.size() != 2 || dims[0] != g.src[0] || saved_per_example(ew.a, g.src[0]) != dims[1])
      throw std::runtime_error("the saved input's shape does not match the backward-weights layout here");
    stream st(eng());
    memory mx(g.s(tag::nhwc), eng(), x.typed_data()), ms(ew.a, eng(), saved->typed_data());
    reorder(mx, ms).execute(st, mx, ms);
    // one reorder of x serves both when the layouts agree
    forward(e, st, g, e.a == ew.a ? ms : in(st, e.a, mx), w.typed_data(), y->typed_data());
  });
}

// dx, dw from dy, w and the forward's residual: x in the backward-weights layout (blocked=1, FwdSave's), or x
// itself (blocked=0, NHWC); dy reordered once when both primitives want one layout.
static ffi::Error Bwd(ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> saved,
                      ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dw, int64_t sh, int64_t sw,
                      int64_t pt, int64_t pb, int64_t pl, int64_t pr, int64_t threads, int64_t always_blocked,
                      int64_t blocked) {
  return guarded(threads, [&] {
    Geo g = geo(dx->dimensions(), w.dimensions(), dy.dimensions(), sh, sw, pt, pb, pl, pr, always_blocked);
    auto& ed = data_entry(g);
    auto& ew = weights_entry(g);
    if (blocked && saved_per_example(ew.a, g.src[0]) != saved.dimensions().back())
      throw std::runtime_error("the saved input's shape does not match the backward-weights layout here");
    stream st(eng());
    memory mdy(g.d(tag::nhwc), eng(), dy.typed_data()), mw(g.w(tag::hwio), eng(), w.typed_data()),
        mdx(g.s(tag::nhwc), eng(), dx->typed_data()), mdw(g.w(tag::hwio), eng(), dw->typed_data());
    auto dy_d = in(st, ed.c, mdy);
    auto dy_w = ew.c == ed.c ? dy_d : in(st, ew.c, mdy);
    auto dx1 = out(ed.a, mdx), w1 = in(st, ed.b, mw);
    ed.p.execute(st, {{DNNL_ARG_SCRATCHPAD, memory(ed.scratch, eng())},
                      {DNNL_ARG_DIFF_SRC, dx1},
                      {DNNL_ARG_WEIGHTS, w1},
                      {DNNL_ARG_DIFF_DST, dy_d}});
    back(st, dx1, mdx);
    auto x1 = blocked ? memory(ew.a, eng(), saved.typed_data())
                      : in(st, ew.a, memory(g.s(tag::nhwc), eng(), saved.typed_data()));
    auto dw1 = out(ew.b, mdw);
    ew.p.execute(st, {{DNNL_ARG_SCRATCHPAD, memory(ew.scratch, eng())},
                      {DNNL_ARG_SRC, x1},
                      {DNNL_ARG_DIFF_WEIGHTS, dw1},
                      {DNNL_ARG_DIFF_DST, dy_w}});
    back(st, dw1, mdw);
    st.wait();
  });
}

// Batched products c[n] = op(a[n]) @ op(b[n]) over plain row-major buffers: a [..., M, K] ([..., K, M] where ta),
// b [..., K, P] ([..., P, K] where tb), c [..., M, P], the leading dims (the same in all three) the N items; a
// transposed operand is read through its strides (no copy). Each
// item's product was the same whatever the items beside it, on 1 and 2 threads (tests/test_onednn_attention.py).
static memory::desc rows(int64_t n, int64_t r, int64_t c, bool transposed) {
  return {{n, r, c}, dt::f32, transposed ? memory::dims{r * c, 1, r} : memory::dims{r * c, c, 1}};
}

static Entry matmul_entry(const memory::desc& a, const memory::desc& b, const memory::desc& c) {
#if DNNL_VERSION_MAJOR >= 3
  matmul::primitive_desc pd(eng(), a, b, c, attr());
#else
  matmul::primitive_desc pd(matmul::desc(a, b, c), attr(), eng());
#endif
  return Entry{matmul(pd), a, b, c, pd.scratchpad_desc()};
}

static ffi::Error Bmm(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> c, int64_t ta,
                      int64_t tb, int64_t threads) {
  return guarded(threads, [&] {
    auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
    size_t r = ad.size();
    if (r < 3 || bd.size() != r || cd.size() != r) throw std::runtime_error("the operands' ranks differ or are < 3");
    int64_t n = 1;
    for (size_t i = 0; i + 2 < r; ++i) n *= ad[i];
    int64_t m = ta ? ad[r - 1] : ad[r - 2], k = ta ? ad[r - 2] : ad[r - 1], p = tb ? bd[r - 2] : bd[r - 1];
    bool same = (tb ? bd[r - 1] : bd[r - 2]) == k && cd[r - 2] == m && cd[r - 1] == p;
    for (size_t i = 0; same && i + 2 < r; ++i) same = bd[i] == ad[i] && cd[i] == ad[i];
    if (!same) throw std::runtime_error("the operands' and the result's shapes do not make a batched product");
    std::string key = "M" + std::to_string(n) + "," + std::to_string(m) + "," + std::to_string(k) + "," +
                      std::to_string(p) + "," + std::to_string(ta) + std::to_string(tb);
    Entry& e = cached(key, [&] { return matmul_entry(rows(n, m, k, ta), rows(n, k, p, tb), rows(n, m, p, false)); });
    stream st(eng());
    e.p.execute(st, {{DNNL_ARG_SCRATCHPAD, memory(e.scratch, eng())},
                     {DNNL_ARG_SRC, memory(e.a, eng(), a.typed_data())},
                     {DNNL_ARG_WEIGHTS, memory(e.b, eng(), b.typed_data())},
                     {DNNL_ARG_DST, memory(e.c, eng(), c->typed_data())}});
    st.wait();
  }, "oneDNN batched product");
}

#define F32 ffi::Buffer<ffi::F32>
// The attributes bind in this order, the handlers' parameters too (XLA decodes them by position).
#define GEOMETRY                                                                                                \
  Attr<int64_t>("sh").Attr<int64_t>("sw").Attr<int64_t>("pt").Attr<int64_t>("pb").Attr<int64_t>("pl").Attr< \
      int64_t>("pr").Attr<int64_t>("threads").Attr<int64_t>("always_blocked")
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainDnnlConvFwd, Fwd,
                              ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Ret<F32>().GEOMETRY);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainDnnlConvFwdSave, FwdSave,
                              ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Ret<F32>().Ret<F32>().GEOMETRY);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainDnnlConvBwd, Bwd,
                              ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Arg<F32>().Ret<F32>().Ret<F32>().GEOMETRY
                                  .Attr<int64_t>("blocked"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtrainDnnlBmm, Bmm,
                              ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Ret<F32>().Attr<int64_t>("ta").Attr<int64_t>(
                                  "tb").Attr<int64_t>("threads"));
