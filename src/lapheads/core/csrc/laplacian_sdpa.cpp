// The op's training node on the CPU, compiled: SDPA's own CPU flash kernel and its backward, plus the Laplacian
// combine and gradient fix-ups, as one C++ autograd node. It is the same computation as lapheads.core._autograd's
// LaplacianSDPA on its CPU flash path, step for step, so outputs and gradients are bit-identical to it (and to SDPA
// plus the combine through autograd); compiled, it skips the Python autograd.Function's per-call cost (forward and
// backward), which is most of what remains of the op's fixed cost at small training shapes.
//
// Heads come as blocks: starts[i] .. stops[i] are the Laplacian query heads, each block on kv-group boundaries
// (GQA: the query heads sharing a kv head are of one kind). The queries are the last T of the S keys.
#include <torch/extension.h>

#include <optional>
#include <vector>

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

struct LaplacianSDPA : public torch::autograd::Function<LaplacianSDPA> {
  static Tensor forward(AutogradContext* ctx, Tensor q, Tensor k, Tensor v, std::optional<Tensor> attn_mask,
                        double dropout_p, bool is_causal, std::optional<double> scale, std::vector<int64_t> starts,
                        std::vector<int64_t> stops) {
    const int64_t group = q.size(1) / k.size(1), t = q.size(2), s = k.size(2);
    auto [y, logsumexp] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask,
                                                                          scale);
    // saved, not kept in saved_data: autograd frees saved tensors after a backward without retain_graph
    variable_list saved{y, q, k, v, logsumexp};
    if (attn_mask.has_value()) {  // never a gradient's input: the op sends a mask needing one to its general combine
      saved.push_back(*attn_mask);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale.has_value() ? c10::IValue(*scale) : c10::IValue();
    ctx->saved_data["starts"] = starts;
    ctx->saved_data["stops"] = stops;
    // a clone keeps y's layout (B, T, H, D strides from a packed projection): the caller's reshape stays a view
    Tensor out = y.clone();
    Tensor v_self = t == s ? v : v.narrow(2, s - t, t);
    for (size_t i = 0; i < starts.size(); ++i) {
      const int64_t start = starts[i], len = stops[i] - starts[i];
      Tensor out_run = out.narrow(1, start, len);
      if (group == 1) {
        at::sub_out(out_run, v_self.narrow(1, start, len), out_run);
      } else {  // v_self broadcast over each group of query heads, uncopied
        Tensor kv = v_self.narrow(1, start / group, len / group).unsqueeze(2);
        Tensor grouped = out_run.view({out.size(0), len / group, group, t, out.size(3)});
        at::sub_out(grouped, kv, grouped);
      }
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &y = saved[0], &q = saved[1], &k = saved[2], &v = saved[3], &logsumexp = saved[4];
    std::optional<Tensor> attn_mask = saved.size() > 5 ? std::optional<Tensor>(saved[5]) : std::nullopt;
    const c10::IValue& scale_value = ctx->saved_data["scale"];
    std::optional<double> scale = scale_value.isNone() ? std::nullopt : std::optional<double>(scale_value.toDouble());
    const Tensor& grad = grads[0];
    auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, y, logsumexp, ctx->saved_data["dropout_p"].toDouble(), ctx->saved_data["is_causal"].toBool(),
        attn_mask, scale);
    const auto starts = ctx->saved_data["starts"].toIntVector(), stops = ctx->saved_data["stops"].toIntVector();
    const int64_t group = q.size(1) / k.size(1), t = grad.size(2), s = k.size(2);
    for (size_t i = 0; i < starts.size(); ++i) {
      // SDPA's backward is linear in the output gradient, head by head: negating a Laplacian block's dq, dk and dv
      // equals feeding it -g; dv then gains g at each query's own position (the last T of the S keys)
      const int64_t start = starts[i], len = stops[i] - starts[i];
      const int64_t kv_start = start / group, kv_len = len / group;
      dq.narrow(1, start, len).neg_();
      dk.narrow(1, kv_start, kv_len).neg_();
      Tensor g_block = grad.narrow(1, start, len), dv_block = dv.narrow(1, kv_start, kv_len);
      if (group > 1) {  // the group's query heads all read their kv head's value
        g_block = g_block.unflatten(1, {kv_len, group}).sum(2);
      }
      if (t == s) {  // one pass: dv = g - dv
        at::sub_out(dv_block, g_block, dv_block);
      } else {  // KV cache: only the last T key positions are the queries' own
        dv_block.neg_().narrow(2, s - t, t).add_(g_block);
      }
    }
    return {ctx->needs_input_grad(0) ? dq : Tensor(), ctx->needs_input_grad(1) ? dk : Tensor(),
            ctx->needs_input_grad(2) ? dv : Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor laplacian_sdpa(Tensor q, Tensor k, Tensor v, std::optional<Tensor> attn_mask, double dropout_p,
                      bool is_causal, std::optional<double> scale, std::vector<int64_t> starts,
                      std::vector<int64_t> stops) {
  return LaplacianSDPA::apply(q, k, v, attn_mask, dropout_p, is_causal, scale, starts, stops);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("laplacian_sdpa", &laplacian_sdpa, "SDPA's CPU flash kernel with Laplacian head blocks, one autograd node");
}
