"""zb_h1's split backward: a stage's layers run forward one `jax.vjp` per layer, and each layer's
backward is cut into its input half (Bx) and its weight half (W).

The vjp of the whole layer scan cannot be cut: its weight gradients sit inside the reverse
scan that carries the activation cotangent, so a W applying it runs that chain again (a whole
backward). Per layer, the backward is a jaxpr from (residuals, output cotangent) to (weight
gradients, input cotangent); its equations split by what they feed:
  Bx  the equations the input cotangent needs (the activation-gradient chain);
  W   the equations only the weight gradients need (the weight matmuls x^T dz, their sums).
Bx evaluates its part and keeps, per layer, the values W's part reads that Bx computed (each
weight matmul's output cotangent dz; the layer's output cotangent, which the last matmul's is)
for W; W evaluates its part from those and the forward's residuals (the matmuls' inputs x, kept
until W), layer by layer with no carry. Bx + W run each equation of the whole backward once, so
the gradients are the same numbers.
Call-like equations (jit, remat) are inlined first: one `jit` whose transpose yields both an
input and a weight cotangent would otherwise be one indivisible equation on Bx's side, and under
train.remat a layer's whole backward is one remat2 equation (the recomputed forward with it).
Inlined, the recomputed forward runs in Bx, which keeps for W the weight matmuls' inputs too.
Where a value W reads comes out of cheap equations (elementwise, broadcasts, reductions: CHEAP)
of values W has anyway (the forward's residuals, kept until W, or another value Bx keeps), W
computes it again instead (`_Cut.recompute_in_w`): the SwiGLU's gate and up cotangents from
the one at its output, so Bx keeps one F-sized value a token and layer instead of two. The
other way, Bx computes a W equation whose output is fewer bytes than the inputs only it reads
(`_Cut.pull_into_bx`: the attention output from the probabilities, where a remat policy did
not save it); the weight matmuls stay in W.
Param residuals are referenced, as in residuals.py. Tracing is deterministic, so the cut made in
one trace (cached here) holds in every other trace of the same stage."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, primitives

from jaxpar import nn
from jaxpar.parallel.pipeline.residuals import StashPlan, bind_lenient
from jaxpar.sharding import vary_together

# By identity, not name: jax.checkpoint's primitive is named "remat2" and call_p / closed_call_p
# are "eval_jaxpr" in jax 0.12 ("call" / "closed_call" in 0.10). A remat'd layer's backward is
# one remat2 equation (the recomputed forward and the whole backward): left shut, it is one
# indivisible equation that feeds the input cotangent, and every weight matmul landed in Bx.
_INLINE = (primitives.jit_p, primitives.call_p, primitives.closed_call_p, primitives.remat_p)
# Equations W may run again rather than have Bx keep their output: a few flops an element.
CHEAP = frozenset({
    "abs", "add", "add_any", "broadcast_in_dim", "convert_element_type", "copy", "div", "exp",
    "expand_dims", "integer_pow", "log", "logistic", "max", "min", "mul", "neg", "pow",
    "reduce_max", "reduce_sum", "reshape", "rsqrt", "select_n", "sign", "sqrt", "square",
    "squeeze", "sub", "tanh"})


def _callee(eqn) -> tuple[Jaxpr, list] | None:
    """The (jaxpr, consts) a call-like equation runs, or None."""
    if eqn.primitive not in _INLINE:
        return None
    sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(sub, ClosedJaxpr):
        return sub.jaxpr, list(sub.consts)
    if isinstance(sub, Jaxpr) and not sub.constvars:
        return sub, []
    return None


@dataclass
class _Cut:
    """A layer backward as flat equations (calls inlined) over integer value keys, cut in two."""

    nodes: list            # (eqn, in atoms: key | Literal, out keys)
    consts: dict           # key -> constant
    in_keys: list          # the jaxpr's inputs: the vjp's leaves, then the cotangent's
    nbytes: dict           # key -> bytes of its value
    x_nodes: list = field(default_factory=list)   # Bx's equations, in order
    w_nodes: list = field(default_factory=list)   # W's
    dx_out: list = field(default_factory=list)    # atoms of the input cotangent
    dw_out: list = field(default_factory=list)    # atoms of the weight gradients
    w_in: list = field(default_factory=list)      # keys W reads that it does not compute

    @classmethod
    def of(cls, closed: ClosedJaxpr, n_weights: int, n_leaves: int) -> "_Cut":
        """The cut of a layer backward with `n_weights` weight gradients first among its
        outputs and `n_leaves` vjp leaves (the forward's residuals and params, which W has
        anyway) first among its inputs."""
        nodes: list = []
        consts: dict = {}
        nbytes: dict = {}
        fresh = itertools.count()

        def size(v, k):
            aval = v.aval
            nbytes[k] = aval.size * aval.dtype.itemsize if hasattr(aval, "dtype") else 0
            return k

        def lower(jaxpr, env):
            for eqn in jaxpr.eqns:
                ins = [a if isinstance(a, Literal) else env[a] for a in eqn.invars]
                sub = _callee(eqn)
                if sub is None:
                    outs = [size(v, next(fresh)) for v in eqn.outvars]
                    nodes.append((eqn, ins, outs))
                else:
                    inner, inner_consts = sub
                    inner_env = dict(zip(inner.invars, ins))
                    for v, c in zip(inner.constvars, inner_consts):
                        inner_env[v] = next(fresh)
                        consts[inner_env[v]] = c
                    outs = lower(inner, inner_env)
                env.update(zip(eqn.outvars, outs))
            return [a if isinstance(a, Literal) else env[a] for a in jaxpr.outvars]

        jaxpr = closed.jaxpr
        env = {v: size(v, next(fresh)) for v in jaxpr.invars}
        for v, c in zip(jaxpr.constvars, closed.consts):
            env[v] = next(fresh)
            consts[env[v]] = c
        cut = cls(nodes, consts, [env[v] for v in jaxpr.invars], nbytes)
        outs = lower(jaxpr, env)
        cut.dw_out, cut.dx_out = outs[:n_weights], outs[n_weights:]
        x_live, w_live = cut._live(cut.dx_out), cut._live(cut.dw_out)
        cut.x_nodes = sorted(x_live)
        cut.w_nodes = sorted(w_live - x_live)
        made = {k for i in cut.w_nodes for k in nodes[i][2]}
        need = [a for i in cut.w_nodes for a in nodes[i][1]] + cut.dw_out
        cut.w_in = sorted({a for a in need if not isinstance(a, Literal) and a not in made
                           and a not in consts})
        have = set(cut.in_keys[:n_leaves])
        producer = {k: i for i, (_, _, outs) in enumerate(nodes) for k in outs}
        cut.pull_into_bx(have, producer)
        cut.recompute_in_w(have, producer)
        return cut

    def _kept(self, keys, have: set) -> int:
        """Bytes of `keys` Bx keeps for W (what W has anyway costs nothing)."""
        return sum(self.nbytes.get(k, 0) for k in keys if k not in have)

    def pull_into_bx(self, have: set, producer: dict) -> None:
        """Move into Bx the W equations whose inputs Bx has and whose outputs are fewer bytes to
        keep than the inputs only they read (under dots_with_no_batch_dims_saveable the
        attention output, a batched dot the policy did not save, from the probabilities: Bx
        keeps [H hd] a token instead of [H, S]). Each equation still runs once. The weight
        matmuls stay in W (the dots that reach a weight gradient through no other dot): they
        are W's work, the bubble filler, whatever their bytes."""
        weight_dots, todo, seen = set(), [k for k in self.dw_out if not isinstance(k, Literal)], set()
        while todo:  # back from the weight gradients through non-dot equations
            k = todo.pop()
            i = producer.get(k)
            if i is None or i in seen:
                continue
            seen.add(i)
            eqn, ins, _ = self.nodes[i]
            if eqn.primitive.name == "dot_general":
                weight_dots.add(i)
            else:
                todo.extend(a for a in ins if not isinstance(a, Literal))
        changed = True
        while changed:
            changed = False
            made_by_w = {k for i in self.w_nodes for k in self.nodes[i][2]}
            readers: dict = {}
            for i in self.w_nodes:
                for a in self.nodes[i][1]:
                    if not isinstance(a, Literal):
                        readers.setdefault(a, set()).add(i)
            for i in self.w_nodes:
                eqn, ins, outs = self.nodes[i]
                keys = {a for a in ins if not isinstance(a, Literal) and a not in self.consts}
                if (i in weight_dots or any(a in made_by_w for a in keys)
                        or any(o in self.dw_out for o in outs)):
                    continue
                freed = {a for a in keys if readers.get(a) == {i} and a not in self.dw_out}
                needed = {o for o in outs if o in readers or o in self.dw_out}
                if self._kept(needed, have) < self._kept(freed, have):
                    self.w_nodes = [j for j in self.w_nodes if j != i]
                    self.x_nodes = sorted(set(self.x_nodes) | {i})
                    self.w_in = sorted((set(self.w_in) - freed) | needed)
                    changed = True
                    break

    def recompute_in_w(self, have: set, producer: dict) -> None:
        """Move into W (again: Bx runs them too) the CHEAP equations whose output W would read
        from Bx, where W can compute it from fewer kept bytes: from `have` (the vjp's leaves,
        which W has anyway), values Bx keeps for W already, or other such equations' outputs.
        Greedy over W's inputs, a tie taken (the SwiGLU's gate cotangent costs its output's
        cotangent, the same size; the up cotangent then costs nothing); kept only if the bytes
        Bx keeps for W fall."""
        made_by_w = {k for i in self.w_nodes for k in self.nodes[i][2]}
        w_nodes, w_in = set(self.w_nodes), set(self.w_in)
        kept = lambda keys: self._kept(keys, have)

        def cone(k, depth=0):
            """(new W inputs, equations) computing k from what W has, or None: keep k."""
            if k in memo:
                return memo[k]
            i = producer.get(k)
            eqn, ins, outs = self.nodes[i] if i is not None else (None, (), ())
            if i is None or depth > 12 or eqn.primitive.name not in CHEAP or len(outs) != 1:
                memo[k] = None
                return None
            new, eqns = set(), {i}
            for a in ins:
                if isinstance(a, Literal) or a in self.consts or a in made_by_w:
                    continue
                if a in have or a in w_in:  # W reads it anyway (an input of W's, at no cost)
                    new.add(a)
                    continue
                sub = cone(a, depth + 1)
                if sub is None or kept(sub[0] - w_in) > self.nbytes.get(a, 0):
                    new.add(a)
                else:
                    new |= sub[0]
                    eqns |= sub[1]
            memo[k] = new, eqns
            return memo[k]

        before = kept(w_in)
        changed = True
        while changed:
            changed, memo = False, {}  # cones hold while W's inputs do
            for k in sorted(w_in, reverse=True):  # the latest first: the backward's last values
                if k in have:
                    continue
                found = cone(k)
                if found is None or kept(found[0] - w_in) > self.nbytes.get(k, 0):
                    continue
                w_in = (w_in - {k}) | found[0]
                w_nodes |= found[1]
                made_by_w |= {o for i in found[1] for o in self.nodes[i][2]}
                changed = True
                break
        if kept(w_in) < before:
            self.w_nodes, self.w_in = sorted(w_nodes), sorted(w_in)

    def _live(self, roots) -> set[int]:
        need = {a for a in roots if not isinstance(a, Literal)}
        live = set()
        for i in reversed(range(len(self.nodes))):
            _, ins, outs = self.nodes[i]
            if any(o in need for o in outs):
                live.add(i)
                need.update(a for a in ins if not isinstance(a, Literal))
        return live

    def run(self, which: list, env: dict, outs: list) -> list:
        env = {**self.consts, **env}
        for i in which:
            eqn, ins, keys = self.nodes[i]
            args = [a.val if isinstance(a, Literal) else env[a] for a in ins]
            env.update(zip(keys, bind_lenient(eqn, args)))
        return [a.val if isinstance(a, Literal) else env[a] for a in outs]


class LayerSplit:
    """One stage's layers forward (per-layer vjps, residuals stacked on the layer dim), and the
    two halves of its backward. `names`: the stage's layer-param names (the runner's `lay`
    keys) in the order of the stack's state leaves, found by identity in the first forward."""

    def __init__(self):
        self.stash = StashPlan()
        self.names: tuple | None = None
        self.cut: _Cut | None = None
        # per key W reads: ("ref", (group, name)) a param, ("res", i) the i-th stashed residual
        # (kept until W), ("w", i) the i-th value Bx keeps for W
        self.w_src: list = []

    def forward(self, stack: nnx.Module, x: Any, fn, lk: dict, top: dict):
        """(stage output, residuals [layers, ...] per kept leaf) of the stage's layers on `x`,
        the layer scan nn.scan_stack runs (params hook, remat policy), one vjp per layer."""
        ctx = nn.current()
        if ctx.layer_taps is not None:
            raise NotImplementedError("pipeline zb_h1 with nn.Context.layer_taps")
        graphdef, state = nnx.split(stack)
        leaves, treedef = jax.tree.flatten(state)
        name_of = {id(a): n for n, a in lk.items()}
        names = tuple(name_of.get(id(a)) for a in leaves)
        if None in names or len(set(names)) != len(lk):
            raise RuntimeError("pipeline zb_h1: the layer stack's state is not the stage's params")
        self.names = names

        def layer(s, c):
            return fn(nnx.merge(graphdef, ctx.layer_params(s)), c)

        if ctx.remat != "none" or ctx.never_save:
            layer = jax.checkpoint(layer, policy=nn.remat_policy(ctx.remat, ctx.never_save),
                                   prevent_cse=False)

        def body(c, ls):
            c, fn_l = jax.vjp(layer, jax.tree.unflatten(treedef, ls), c)
            return c, self.stash.split(fn_l, {"lay": dict(zip(names, ls)), "top": top})

        x = vary_together(x, leaves)
        return jax.lax.scan(body, x, leaves)

    def _cut(self, g) -> _Cut:
        if self.cut is None:
            cut = _Cut.of(self.stash.program(g)[0], len(self.names), len(self.stash.refs))
            refs = dict(zip(cut.in_keys, self.stash.refs))  # the cotangent's keys have none
            kept_at = {k: i for i, k in enumerate(k for k, r in zip(cut.in_keys, self.stash.refs)
                                                  if r is None)}
            n = itertools.count()
            self.w_src = [("ref", refs[k]) if refs.get(k) else ("res", kept_at[k]) if k in kept_at
                          else ("w", next(n)) for k in cut.w_in]
            self.cut = cut
        return self.cut

    def _leaves(self, kept: list, lay: dict, top: dict) -> list:
        it = iter(kept)
        return [next(it) if r is None else {"lay": lay, "top": top}[r[0]][r[1]] for r in self.stash.refs]

    def input_half(self, kept: list, lk: dict, top: dict, g):
        """Bx: (the stage's input cotangent, what W reads [layers, ...]), the layers in reverse."""
        def body(g, xs):
            kept_l, ls = xs
            leaves = self._leaves(kept_l, dict(zip(self.names, ls)), top)
            g_leaves = jax.tree.leaves(g)
            cut = self._cut(g)
            env = dict(zip(cut.in_keys, leaves + g_leaves))
            kept_w = [k for k, (src, _) in zip(cut.w_in, self.w_src) if src == "w"]
            out = cut.run(cut.x_nodes, env, cut.dx_out + kept_w)
            dx = jax.tree.unflatten(jax.tree.structure(g), out[:len(g_leaves)])
            return dx, out[len(g_leaves):]

        return jax.lax.scan(body, g, (kept, [lk[n] for n in self.names]), reverse=True)

    def weight_half(self, kept: list, ring: list, slot, lk: dict, top: dict) -> dict:
        """W: the stage's layer-param gradients {name: [layers, ...]} from the forward's residuals
        `kept` and what Bx kept, slot `slot` of the runner's w `ring` ([slots, layers, ...]
        each), layer by layer (a scan with no carry: no chain between layers). Each layer slices
        its own from the ring: the slot is never copied out whole."""
        res = sorted({at for src, at in self.w_src if src == "res"})

        def body(_, xs):
            res_l, layer, ls = xs
            w_l = [jax.lax.dynamic_slice(b, (slot, layer) + (0,) * (b.ndim - 2), (1, 1) + b.shape[2:])
                   .reshape(b.shape[2:]) for b in ring]
            known = {"lay": dict(zip(self.names, ls)), "top": top, "res": dict(zip(res, res_l)),
                     "w": w_l}
            env = {k: known[at[0]][at[1]] if src == "ref" else known[src][at]
                   for k, (src, at) in zip(self.cut.w_in, self.w_src)}
            return None, self.cut.run(self.cut.w_nodes, env, self.cut.dw_out)

        layers = jnp.arange(len(lk[self.names[0]]), dtype=jnp.int32)
        _, dw = jax.lax.scan(body, None, ([kept[i] for i in res], layers, [lk[n] for n in self.names]))
        return dict(zip(self.names, dw))
