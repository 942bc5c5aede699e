"""Every option composes: random batches (prefix forests, owners, vision tokens) under random
configs over every option. Each returned plan passes ``validate()`` and an independent recount
(every sample once or dropped with a reason, equal counts per step, what each GPU holds under the
cap — recounted here from the layout rules, the forest and the padding, not from the planner's
footprint — the vision cap, samples on their owner, token-mean weights summing to W); every
refusal is a PlanError from the table in docs/planner.md ("What composes") or a data-dependent
refusal (a sample over the cap, a step that cannot fill its ranks, steps that cannot form).
"""

from __future__ import annotations

import re

import numpy as np
from hypothesis import event, given, note
from hypothesis import strategies as st

import microplan as mp
from microplan.prefix import micro_tree

#: config-level refusals of docs/planner.md's table (PlanConfig raises them; any option mix else plans)
TABLE = [
    (lambda o: o["share"] and o["layout"] != "varlen", "own padded row"),
    (lambda o: o["share"] and o["static"], "needs dynamic batching"),
    (lambda o: o["local"] and o["cp"] == "dynamic", "dynamic context parallel"),
    (lambda o: o["cp"] is not None and o["static"], "context_parallel needs dynamic batching"),
    (lambda o: o["vcap"] and o["static"], "max_vision_tokens_per_micro needs dynamic batching"),
    (lambda o: o["cp"] == "dynamic" and o["layout"] != "varlen", "dynamic context parallel"),
]
#: refusals that depend on the data, whatever the options
DATA = re.compile(r"more than one micro-batch may hold|cannot fill|found no prefix|no rank may run an empty|"
                  r"needs \d+ GPUs|every rank runs K=|steps?|padding to a multiple of|vision tokens, more")


@st.composite
def batches(draw):
    n = draw(st.integers(1, 36))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    lens = rng.integers(1, draw(st.sampled_from([8, 40, 120])) + 1, n)
    group = draw(st.sampled_from([1, 2, 4]))
    pids = np.arange(n) // group
    parent = np.full(n, -1, dtype=np.int64)
    shared = np.zeros(n, dtype=np.int64)
    p_link = draw(st.sampled_from([0.0, 0.6, 0.9]))
    for i in range(1, n):
        if rng.random() < p_link:
            j = int(rng.integers(max(0, i - 6), i))
            s = int(rng.integers(1, min(lens[i], lens[j]) + 1))
            parent[i], shared[i] = j, s
    kw = dict(prompt_ids=pids, prefix_parent=parent, shared_prefix_lens=shared,
              prompt_lens=np.minimum(lens, rng.integers(1, 9, n)))
    dp = draw(st.integers(1, 6))
    kw["rank_of"] = rng.integers(0, dp, n)
    if draw(st.booleans()):
        kw["vision_tokens"] = rng.integers(0, 30, n)
    return mp.Batch(lens, **kw), dp


@st.composite
def options(draw):
    """Every option, biased toward combinations that plan (a refusal is checked against the table)."""
    refusable = draw(st.integers(0, 4)) == 0   # one draw in five may pick a documented refusal
    share = draw(st.booleans())
    layouts = ["varlen", "padded", "padded-2d"] if refusable or not share else ["varlen"]
    cps = [None, "fixed", "dynamic"] if refusable else [None, None, "fixed"] if not share else [None]
    return dict(share=share, local=draw(st.booleans()), layout=draw(st.sampled_from(layouts)),
                mult=draw(st.sampled_from([1, 1, 2, 4])), row=draw(st.sampled_from([1, 1, 4, 8])),
                vcap=draw(st.booleans()), pipe=draw(st.sampled_from([1, 1, 2])), align=draw(st.sampled_from([1, 2])),
                short=draw(st.sampled_from(["pad", "drop", "error"])),
                static=draw(st.booleans()) if refusable or not share else False,
                cp=draw(st.sampled_from(cps)), cap=draw(st.integers(8, 300)),
                steps=draw(st.sampled_from([None, 1, 2])), loss=draw(st.sampled_from(["token-mean", "prompt-mean"])),
                hedged=draw(st.booleans()), priced=draw(st.sampled_from([None, "one rate", "nodes"])))


#: a cost whose attention is known to ±20 % (what CostMeter hands out): the hedged pass runs
HEDGED = mp.FlopsCost(linear=1.0, quadratic=1e-2, per_micro=4.0, attention_rel_sd=0.2)
#: CP priced: one rate, or a node of one GPU so that every split group crosses nodes at 10x the rate
PRICED = {"one rate": mp.CPCost(comm_per_token=0.2, efficiency=0.9, split_overhead=2.0),
          "nodes": mp.CPCost(comm_per_token=0.2, efficiency=0.9, split_overhead=2.0, node_size=1,
                             cross_node_comm_per_token=2.0)}


def _cost(o):
    if o["priced"] is None:
        return {"cost": HEDGED} if o["hedged"] else {}
    base = HEDGED if o["hedged"] else mp.FlopsCost(linear=1.0, quadratic=1e-2, per_micro=4.0)
    return {"cost": mp.FlopsCost(linear=base.linear, quadratic=base.quadratic, per_micro=base.per_micro,
                                 attention_rel_sd=base.attention_rel_sd, cp=PRICED[o["priced"]])}


def _config(o, dp):
    cp = None if o["cp"] is None else mp.ContextParallel(size=2) if o["cp"] == "fixed" else mp.ContextParallel(max_size=2)
    return mp.PlanConfig(
        dp_size=dp * (2 if o["cp"] == "dynamic" else 1), max_tokens_per_micro=None if o["static"] else o["cap"],
        micro_batch_size=3 if o["static"] else None, share_prefixes=o["share"],
        placement="local" if o["local"] else "global", layout=o["layout"], pad_to_multiple_of=o["mult"],
        pad_row_to_multiple_of=o["row"], max_vision_tokens_per_micro=60 if o["vcap"] else None,
        pipeline_stages=o["pipe"], align=o["align"], short_step=o["short"], context_parallel=cp,
        steps=None if o["steps"] is None else mp.Steps(prompts_per_step=o["steps"]), loss=mp.Loss(o["loss"]),
        **_cost(o))


def _held(m: mp.Micro, b: mp.Batch, cfg: mp.PlanConfig) -> int:
    """Tokens the GPUs hold, recounted from the rules (docs/layouts.md, docs/prefix.md)."""
    up = lambda x, k: -(-x // k) * k  # noqa: E731
    idx = m.indices
    if cfg.share_prefixes:  # the trie's runs padded, or the samples flat where that is smaller
        t = micro_tree(b.prefix_parent, b.shared_prefix_lens, b.seq_lens, idx)
        m, r = cfg.pad_to_multiple_of, cfg.pad_row_to_multiple_of
        tree = int(sum(up(int(e - s), m) for s, e in zip(t.start, t.end)))
        flat = int(sum(up(int(x), m) for x in b.seq_lens[idx]))
        work_t = t.depth_sq + (up(tree, r) - tree) ** 2          # attention work, the row pad one more sequence
        work_f = int(sum(up(int(x), m) ** 2 for x in b.seq_lens[idx])) + (up(flat, r) - flat) ** 2
        return up(flat if flat < tree or up(flat, r) < up(tree, r) or work_f < work_t else tree, r)
    L = b.seq_lens[idx]
    if cfg.layout == "varlen":
        return up(int(sum(up(int(x), cfg.pad_to_multiple_of) for x in L)), cfg.pad_row_to_multiple_of)
    w_mult = np.lcm(cfg.pad_to_multiple_of, cfg.pad_row_to_multiple_of)
    if cfg.layout == "padded":
        return len(idx) * up(int(L.max()), w_mult)
    p = b.prompt_lens[idx]
    return len(idx) * up(int(p.max()) + int((L - p).max()), w_mult)


def _recount(plan: mp.Plan, b: mp.Batch, cfg: mp.PlanConfig) -> None:
    seen = np.zeros(b.num_samples, dtype=np.int64)
    W = cfg.grad_world
    for step in plan.steps:
        assert all(len(row) == step.micro_count for row in step.micros)
        assert step.micro_count % cfg.align == 0 and step.micro_count >= cfg.pipeline_stages
        total = 0.0
        for r, row in enumerate(step.micros):
            for m in row:
                head = m.cp_rank == 0  # a dynamic CP group's members each hold a shard of the same samples
                seen[m.indices] += head
                if m.is_placeholder:
                    continue
                if cfg.placement == "local":
                    assert (b.rank_of[m.indices] == r).all()
                if cfg.max_tokens_per_micro is not None:
                    assert _held(m, b, cfg) == m.num_tokens
                    assert -(-m.num_tokens // m.cp_size) <= cfg.max_tokens_per_micro
                if cfg.max_vision_tokens_per_micro is not None and b.vision_tokens is not None:
                    assert int(b.vision_tokens[m.indices].sum()) <= cfg.max_vision_tokens_per_micro
                if head:
                    total += float((m.loss_scale * m.loss_tokens).sum())
        if cfg.loss.mode == "token-mean" and b.loss_tokens[step.samples].sum() > 0:
            assert abs(total - W) <= 1e-9 * W
    assert ((seen == 1) | np.isin(np.arange(b.num_samples), plan.dropped)).all()
    assert not (seen[plan.dropped] > 0).any()
    assert set(plan.drop_reasons) == set(plan.dropped.tolist())


@given(bd=batches(), o=options())
def test_every_option_combination_plans_or_is_refused_by_the_table(bd, o):
    b, dp = bd
    note(f"options: {o}")
    expected = [why for rule, why in TABLE if rule(o)]
    try:
        cfg = _config(o, dp)
    except mp.PlanError as exc:
        assert expected or DATA.search(str(exc)), f"config refused outside the table: {exc}"
        event("refused by config")
        return
    assert not expected, f"the table says {expected} is refused, but PlanConfig accepted {o}"
    try:
        plan = mp.plan(b, cfg)
    except mp.PlanError as exc:
        assert DATA.search(str(exc)), f"plan refused outside the documented data-dependent refusals: {exc}"
        event("data-dependent refusal")
        return
    plan.validate()
    _recount(plan, b, cfg)
    st_ = plan.stats  # the bound stays a bound whatever composes (a priced CP split counts its GPU-time)
    assert st_.time_lower_bound <= st_.predicted_time * (1 + 1e-9)
    assert st_.split_lower_bound <= st_.predicted_time * (1 + 1e-9)  # local: the bound the split allows
    back = mp.Plan.from_json(plan.to_json())  # every composition round-trips exactly
    assert back == plan and back.fingerprint() == plan.fingerprint()
    event("planned")


@given(bd=batches(), cap=st.integers(30, 300), local=st.booleans(), mult=st.sampled_from([1, 4]))
def test_sharing_short_step_policies_agree_when_pad_needs_no_placeholder(bd, cap, local, mult):
    """With sharing, 'error' and 'drop' give exactly the 'pad' plan whenever 'pad' needs no
    placeholder (they used to refuse or re-plan such steps: tree parts were counted as samples);
    when 'pad' uses placeholders, 'error' either finds a granularity that needs none or raises
    naming samples."""
    b, dp = bd
    kw = dict(dp_size=dp, max_tokens_per_micro=cap, share_prefixes=True, pad_to_multiple_of=mult,
              placement="local" if local else "global")
    try:
        pad = mp.plan(b, mp.PlanConfig(short_step="pad", **kw))
    except mp.PlanError as exc:
        assert DATA.search(str(exc)), str(exc)
        return
    if pad.stats.num_placeholders:
        try:
            err = mp.plan(b, mp.PlanConfig(short_step="error", **kw))
        except mp.PlanError as exc:
            assert "sample" in str(exc)
        else:
            err.validate()
            assert err.stats.num_placeholders == 0
        return
    for policy in ("error", "drop"):
        other = mp.plan(b, mp.PlanConfig(short_step=policy, **kw))
        assert [s.micros for s in other.steps] == [s.micros for s in pad.steps], policy
