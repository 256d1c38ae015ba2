// A measured prototype, not used by jaxtrain (issue 36): oneDNN's convolution forward, backward-data and
// backward-weights as XLA FFI handlers on CPU, for NHWC activations and HWIO kernels. The primitives use
// oneDNN's own (blocked) layouts, reached by reorders from and to XLA's buffers on every call; DNNL_NHWC=1 makes
// them take the plain layouts instead (oneDNN 2.6 then picks its slower gemm kernels). Built by build.sh.
#include <mutex>
#include <string>
#include <unordered_map>
#include <oneapi/dnnl/dnnl.hpp>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace dnnl;
using tag = memory::format_tag;
using dt = memory::data_type;

static engine& eng() { static engine e(engine::kind::cpu, 0); return e; }

struct Geo {
  memory::dims src, wei, dst, strides, pl, pr;
  std::string key(const char* k) const {
    std::string s(k);
    for (auto* v : {&src, &wei, &dst, &strides, &pl, &pr}) { for (auto d : *v) s += "," + std::to_string(d); s += ";"; }
    return s;
  }
};

// x: [N,H,W,C] -> dims {N,C,H,W}; w: [KH,KW,I,O] -> dims {O,I,KH,KW}
static Geo geo(ffi::Span<const int64_t> x, ffi::Span<const int64_t> w, ffi::Span<const int64_t> y, int64_t sh, int64_t sw,
               int64_t pt, int64_t pb, int64_t pl, int64_t pr) {
  Geo g;
  g.src = {x[0], x[3], x[1], x[2]};
  g.wei = {w[3], w[2], w[0], w[1]};
  g.dst = {y[0], y[3], y[1], y[2]};
  g.strides = {sh, sw}; g.pl = {pt, pl}; g.pr = {pb, pr};
  return g;
}

static tag T(tag t) { return getenv("DNNL_NHWC") ? t : tag::any; }
static primitive_attr attr() {
  primitive_attr a;
  a.set_scratchpad_mode(scratchpad_mode::user);
  return a;
}

static convolution_forward::primitive_desc fwd_pd(const Geo& g) {
  auto s = memory::desc(g.src, dt::f32, T(tag::nhwc)), w = memory::desc(g.wei, dt::f32, T(tag::hwio)),
       d = memory::desc(g.dst, dt::f32, T(tag::nhwc));
  auto desc = convolution_forward::desc(prop_kind::forward_training, algorithm::convolution_direct, s, w, d, g.strides,
                                        g.pl, g.pr);
  return convolution_forward::primitive_desc(desc, attr(), eng());
}

// Each call brings its own scratchpad: XLA runs independent custom calls (and each virtual device's) at the same
// time, and the library-managed scratchpad is shared between concurrent executions (wrong results seen).
struct Entry { primitive p; memory::desc a, b, c, scratch; };  // descs of the args in call order
static std::mutex mu;
static std::unordered_map<std::string, Entry> cache;

template <class F>
static Entry& cached(const std::string& k, F make) {
  std::lock_guard<std::mutex> l(mu);
  auto it = cache.find(k);
  if (it == cache.end()) it = cache.emplace(k, make()).first;
  return it->second;
}

// user memory -> the primitive's layout (a reorder when they differ)
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

// The backward-weights primitive's layout of the input, its size in floats (the forward's residual).
static Entry& fentry(const Geo& g) {
  return cached(g.key("f"), [&] {
    auto pd = fwd_pd(g);
    return Entry{convolution_forward(pd), pd.src_desc(), pd.weights_desc(), pd.dst_desc(), pd.scratchpad_desc()};
  });
}

static Entry& wentry(const Geo& g) {
  return cached(g.key("w"), [&] {
    auto s = memory::desc(g.src, dt::f32, T(tag::nhwc)), wd = memory::desc(g.wei, dt::f32, T(tag::hwio)),
         d = memory::desc(g.dst, dt::f32, T(tag::nhwc));
    auto desc = convolution_backward_weights::desc(algorithm::convolution_direct, s, wd, d, g.strides, g.pl, g.pr);
    auto pd = convolution_backward_weights::primitive_desc(desc, attr(), eng(), fwd_pd(g));
    return Entry{convolution_backward_weights(pd), pd.src_desc(), pd.diff_weights_desc(), pd.diff_dst_desc(),
                 pd.scratchpad_desc()};
  });
}

static Entry& dentry(const Geo& g) {
  return cached(g.key("d"), [&] {
    auto s = memory::desc(g.src, dt::f32, T(tag::nhwc)), wd = memory::desc(g.wei, dt::f32, T(tag::hwio)),
         d = memory::desc(g.dst, dt::f32, T(tag::nhwc));
    auto desc = convolution_backward_data::desc(algorithm::convolution_direct, s, wd, d, g.strides, g.pl, g.pr);
    auto pd = convolution_backward_data::primitive_desc(desc, attr(), eng(), fwd_pd(g));
    return Entry{convolution_backward_data(pd), pd.diff_src_desc(), pd.weights_desc(), pd.diff_dst_desc(),
                 pd.scratchpad_desc()};
  });
}

static ffi::Error Fwd(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y, int64_t sh,
                      int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr) {
  Geo g = geo(x.dimensions(), w.dimensions(), y->dimensions(), sh, sw, pt, pb, pl, pr);
  auto& e = fentry(g);
  stream st(eng());
  memory ms({g.src, dt::f32, tag::nhwc}, eng(), x.typed_data()), mw({g.wei, dt::f32, tag::hwio}, eng(), w.typed_data()),
      md({g.dst, dt::f32, tag::nhwc}, eng(), y->typed_data());
  auto s1 = in(st, e.a, ms), w1 = in(st, e.b, mw), d1 = out(e.c, md);
  e.p.execute(st, {{DNNL_ARG_SCRATCHPAD, memory(e.scratch, eng())}, {DNNL_ARG_SRC, s1}, {DNNL_ARG_WEIGHTS, w1}, {DNNL_ARG_DST, d1}});
  back(st, d1, md);
  st.wait();
  return ffi::Error::Success();
}

static ffi::Error BwdData(ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> dx, int64_t sh,
                          int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr) {
  Geo g = geo(dx->dimensions(), w.dimensions(), dy.dimensions(), sh, sw, pt, pb, pl, pr);
  auto& e = dentry(g);
  stream st(eng());
  memory ms({g.src, dt::f32, tag::nhwc}, eng(), dx->typed_data()), mw({g.wei, dt::f32, tag::hwio}, eng(), w.typed_data()),
      md({g.dst, dt::f32, tag::nhwc}, eng(), dy.typed_data());
  auto s1 = out(e.a, ms), w1 = in(st, e.b, mw), d1 = in(st, e.c, md);
  e.p.execute(st, {{DNNL_ARG_SCRATCHPAD, memory(e.scratch, eng())}, {DNNL_ARG_DIFF_SRC, s1}, {DNNL_ARG_WEIGHTS, w1}, {DNNL_ARG_DIFF_DST, d1}});
  back(st, s1, ms);
  st.wait();
  return ffi::Error::Success();
}

static ffi::Error BwdWeights(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dy, ffi::ResultBuffer<ffi::F32> dw,
                             int64_t sh, int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr) {
  Geo g = geo(x.dimensions(), dw->dimensions(), dy.dimensions(), sh, sw, pt, pb, pl, pr);
  auto& e = wentry(g);
  stream st(eng());
  memory ms({g.src, dt::f32, tag::nhwc}, eng(), x.typed_data()), mw({g.wei, dt::f32, tag::hwio}, eng(), dw->typed_data()),
      md({g.dst, dt::f32, tag::nhwc}, eng(), dy.typed_data());
  auto s1 = in(st, e.a, ms), w1 = out(e.b, mw), d1 = in(st, e.c, md);
  e.p.execute(st, {{DNNL_ARG_SCRATCHPAD, memory(e.scratch, eng())}, {DNNL_ARG_SRC, s1}, {DNNL_ARG_DIFF_WEIGHTS, w1}, {DNNL_ARG_DIFF_DST, d1}});
  back(st, w1, mw);
  st.wait();
  return ffi::Error::Success();
}


// y = conv(x, w), and x in the backward-weights layout (res: at least that many floats).
static ffi::Error FwdSave(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y,
                          ffi::ResultBuffer<ffi::F32> res, int64_t sh, int64_t sw, int64_t pt, int64_t pb, int64_t pl,
                          int64_t pr) {
  Geo g = geo(x.dimensions(), w.dimensions(), y->dimensions(), sh, sw, pt, pb, pl, pr);
  auto& e = fentry(g);
  auto& ew = wentry(g);
  stream st(eng());
  memory ms({g.src, dt::f32, tag::nhwc}, eng(), x.typed_data()), mw({g.wei, dt::f32, tag::hwio}, eng(), w.typed_data()),
      md({g.dst, dt::f32, tag::nhwc}, eng(), y->typed_data());
  memory saved(ew.a, eng(), res->typed_data());
  memory s1 = e.a == ms.get_desc() ? ms : (e.a == ew.a ? saved : memory(e.a, eng()));
  if (s1.get_data_handle() != ms.get_data_handle()) reorder(ms, s1).execute(st, ms, s1);
  if (saved.get_data_handle() != s1.get_data_handle()) reorder(ms, saved).execute(st, ms, saved);
  auto w1 = in(st, e.b, mw), d1 = out(e.c, md);
  e.p.execute(st, {{DNNL_ARG_SCRATCHPAD, memory(e.scratch, eng())}, {DNNL_ARG_SRC, s1}, {DNNL_ARG_WEIGHTS, w1}, {DNNL_ARG_DST, d1}});
  back(st, d1, md);
  st.wait();
  return ffi::Error::Success();
}

// dx, dw from dy, w and the forward's residual; dy reordered once when both primitives want one layout.
static ffi::Error Bwd(ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> res,
                      ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dw, int64_t sh, int64_t sw, int64_t pt,
                      int64_t pb, int64_t pl, int64_t pr) {
  Geo g = geo(dx->dimensions(), w.dimensions(), dy.dimensions(), sh, sw, pt, pb, pl, pr);
  auto& ed = dentry(g);
  auto& ew = wentry(g);
  stream st(eng());
  memory mx({g.src, dt::f32, tag::nhwc}, eng(), dx->typed_data()), mw({g.wei, dt::f32, tag::hwio}, eng(), w.typed_data()),
      mdy({g.dst, dt::f32, tag::nhwc}, eng(), dy.typed_data()),
      mdw({g.wei, dt::f32, tag::hwio}, eng(), dw->typed_data()), saved(ew.a, eng(), res.typed_data());
  auto dy_d = in(st, ed.c, mdy);
  auto dy_w = ew.c == ed.c ? dy_d : in(st, ew.c, mdy);
  auto x1 = out(ed.a, mx), w1 = in(st, ed.b, mw);
  ed.p.execute(st, {{DNNL_ARG_SCRATCHPAD, memory(ed.scratch, eng())}, {DNNL_ARG_DIFF_SRC, x1}, {DNNL_ARG_WEIGHTS, w1}, {DNNL_ARG_DIFF_DST, dy_d}});
  back(st, x1, mx);
  auto dw1 = out(ew.b, mdw);
  ew.p.execute(st, {{DNNL_ARG_SCRATCHPAD, memory(ew.scratch, eng())}, {DNNL_ARG_SRC, saved}, {DNNL_ARG_DIFF_WEIGHTS, dw1}, {DNNL_ARG_DIFF_DST, dy_w}});
  back(st, dw1, mdw);
  st.wait();
  return ffi::Error::Success();
}

// Floats the residual needs for these shapes (called at trace time through a tiny handler-free C entry point).
extern "C" int64_t dnnl_residual_floats(int64_t n, int64_t h, int64_t w, int64_t c, int64_t kh, int64_t kw, int64_t o,
                                        int64_t ho, int64_t wo, int64_t sh, int64_t sw, int64_t pt, int64_t pb,
                                        int64_t pl, int64_t pr) {
  Geo g;
  g.src = {n, c, h, w}; g.wei = {o, c, kh, kw}; g.dst = {n, o, ho, wo};
  g.strides = {sh, sw}; g.pl = {pt, pl}; g.pr = {pb, pr};
  return (int64_t)(wentry(g).a.get_size() / sizeof(float));
}
#define ATTRS .Attr<int64_t>("sh").Attr<int64_t>("sw").Attr<int64_t>("pt").Attr<int64_t>("pb").Attr<int64_t>("pl").Attr<int64_t>("pr")
XLA_FFI_DEFINE_HANDLER_SYMBOL(DnnlConvFwd, Fwd,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>() ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DnnlConvBwdData, BwdData,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>() ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DnnlConvBwdWeights, BwdWeights,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>() ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DnnlConvFwdSave, FwdSave,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
        .Ret<ffi::Buffer<ffi::F32>>() ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DnnlConvBwd, Bwd,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
        .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>() ATTRS);
