// A probe's kernel (tools/cpu-probes/onednn_attention.py): oneDNN's batched matmul c[n] = op(a[n]) @ op(b[n]) as an
// XLA FFI handler on CPU, f32, plain row-major buffers (a transposed operand read through its strides, no copy).
// oneDNN 3's API (the pip wheel's, jaxtrain's cpu-conv extra). Each call brings its own scratchpad, as
// jaxtrain/kernels/onednn_conv.cc's calls do (a library-managed one is shared between concurrent executions).
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include <omp.h>
#include <oneapi/dnnl/dnnl.hpp>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace dnnl;
using dt = memory::data_type;

static engine& eng() {
  static engine e(engine::kind::cpu, 0);
  return e;
}

struct Entry {
  matmul::primitive_desc pd;
  matmul p;
};
static std::mutex mu;
static std::unordered_map<std::string, Entry> cache;

// a: [N, M, K] ([N, K, M] where ta), b: [N, K, P] ([N, P, K] where tb), c: [N, M, P].
static ffi::Error Bmm(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> c, int64_t ta,
                      int64_t tb, int64_t threads) {
  try {
    omp_set_num_threads((int)threads);
    auto ad = a.dimensions(), bd = b.dimensions();
    int64_t n = ad[0], m = ta ? ad[2] : ad[1], k = ta ? ad[1] : ad[2], p = tb ? bd[1] : bd[2];
    std::string key = std::to_string(n) + "," + std::to_string(m) + "," + std::to_string(k) + "," +
                      std::to_string(p) + "," + std::to_string(ta) + std::to_string(tb) + "@" +
                      std::to_string(threads);
    Entry* e;
    {
      std::lock_guard<std::mutex> guard(mu);
      auto it = cache.find(key);
      if (it == cache.end()) {
        memory::desc amd({n, m, k}, dt::f32, ta ? memory::dims{m * k, 1, m} : memory::dims{m * k, k, 1});
        memory::desc bmd({n, k, p}, dt::f32, tb ? memory::dims{k * p, 1, k} : memory::dims{k * p, p, 1});
        memory::desc cmd({n, m, p}, dt::f32, memory::dims{m * p, p, 1});
        primitive_attr attr;
        attr.set_scratchpad_mode(scratchpad_mode::user);
        matmul::primitive_desc pd(eng(), amd, bmd, cmd, attr);
        it = cache.emplace(key, Entry{pd, matmul(pd)}).first;
      }
      e = &it->second;
    }
    stream st(eng());
    memory ma(e->pd.src_desc(), eng(), a.typed_data()), mb(e->pd.weights_desc(), eng(), b.typed_data()),
        mc(e->pd.dst_desc(), eng(), c->typed_data());
    e->p.execute(st, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc},
                      {DNNL_ARG_SCRATCHPAD, memory(e->pd.scratchpad_desc(), eng())}});
    st.wait();
    return ffi::Error::Success();
  } catch (std::exception& ex) {
    return ffi::Error(ffi::ErrorCode::kInternal, ex.what());
  }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeDnnlBmm, Bmm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("ta")
                                  .Attr<int64_t>("tb")
                                  .Attr<int64_t>("threads"));
