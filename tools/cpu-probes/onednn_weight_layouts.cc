// oneDNN 3.2 (the pip wheel's), one convolution (3x3, stride 1, pad 1, NHWC activations): backward-weights
// with its own weights layout and a reorder to HWIO vs writing HWIO directly, and the forward with its own
// weights layout (reordered from HWIO) vs reading HWIO (docs/performance.md, "BatchNorm's collectives", the
// last paragraph). Build and run from the repository root:
//   g++ -O1 -fopenmp tools/cpu-probes/onednn_weight_layouts.cc -I.venv/include -L.venv/lib \
//       -Wl,-rpath,$PWD/.venv/lib -ldnnl -o /tmp/weight_layouts
//   /tmp/weight_layouts BATCH CIN COUT SIZE THREADS      # e.g. 32 512 512 4 1, 32 64 64 28 1
#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>
#include <chrono>
#include <functional>
#include <cstdio>
using namespace dnnl; using tag = memory::format_tag; using dt = memory::data_type;
double ms(std::function<void()> f, int reps=5) { f(); auto t = std::chrono::steady_clock::now(); for (int i=0;i<reps;++i) f(); return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now()-t).count()/reps; }
int main(int argc, char** argv) {
  int N = atoi(argv[1]), C = atoi(argv[2]), O = atoi(argv[3]), H = atoi(argv[4]); omp_set_num_threads(atoi(argv[5]));
  engine eng(engine::kind::cpu, 0); stream st(eng);
  memory::dims src{N, C, H, H}, wei{O, C, 3, 3}, dst{N, O, H, H}, s{1,1}, p{1,1};
  memory::desc xs(src, dt::f32, tag::nhwc), ys(dst, dt::f32, tag::nhwc);
  for (auto wt : {tag::any, tag::hwio}) {
    auto fpd = convolution_forward::primitive_desc(eng, prop_kind::forward_training, algorithm::convolution_direct, xs, memory::desc(wei, dt::f32, tag::any), ys, s, p, p);
    auto bpd = convolution_backward_weights::primitive_desc(eng, algorithm::convolution_direct, xs, memory::desc(wei, dt::f32, wt), ys, s, p, p, fpd);
    memory x(xs, eng), dy(ys, eng), dw(bpd.diff_weights_desc(), eng), user(memory::desc(wei, dt::f32, tag::hwio), eng);
    bool same = bpd.diff_weights_desc() == user.get_desc();
    double t = ms([&]{ convolution_backward_weights(bpd).execute(st, {{DNNL_ARG_SRC, x}, {DNNL_ARG_DIFF_DST, dy}, {DNNL_ARG_DIFF_WEIGHTS, dw}}); if (!same) reorder(dw, user).execute(st, dw, user); st.wait(); });
    printf("bwd-w weights %s: impl %s, %.2f ms (with reorder %d)\n", wt == tag::any ? "any" : "hwio", bpd.impl_info_str(), t, !same);
  }
  for (auto wt : {tag::any, tag::hwio}) {
    auto fpd = convolution_forward::primitive_desc(eng, prop_kind::forward_training, algorithm::convolution_direct, memory::desc(src, dt::f32, tag::any), memory::desc(wei, dt::f32, wt), memory::desc(dst, dt::f32, tag::any), s, p, p);
    memory x(fpd.src_desc(), eng), y(fpd.dst_desc(), eng), w(fpd.weights_desc(), eng), user(memory::desc(wei, dt::f32, tag::hwio), eng);
    bool same = fpd.weights_desc() == user.get_desc();
    double t = ms([&]{ if (!same) reorder(user, w).execute(st, user, w); convolution_forward(fpd).execute(st, {{DNNL_ARG_SRC, x}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, y}}); st.wait(); });
    printf("fwd weights %s: impl %s, %.2f ms\n", wt == tag::any ? "any" : "hwio", fpd.impl_info_str(), t);
  }
}
