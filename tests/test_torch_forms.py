"""Hand-written attention in every calling form torch accepts and at every rank, read the same way.

One attention (projections, scaled scores, a mask, softmax, weights @ V) is written in each *form* (operators,
methods, keyword arguments, functions, unbound ``torch.Tensor`` methods, in-place ops, ``out=``, mm/bmm/mv,
einsum with operands spread or in a list, ``nn.Softmax``, additive masks, ``torch.where``, ``scores[...] = -inf``)
and at each *rank* (a 1-D query vector, 2-D (query, key) scores, 3-D (batch, query, key), 4-D
(batch, head, query, key), heads folded into the batch for bmm). Each correct variant must give the full record,
equal to attention computed here from the module's own weights, with no lint and no warning; each classic bug must
be flagged in every form.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_helpers import leftovers, reference_weights

import attnprobe
from attnprobe.hooks.trace.ops import read_call

B, T, H, DH = 2, 5, 2, 4
D = H * DH
ALL = frozenset({"q", "k", "v", "scores", "weights", "output", "allowed"})
X = torch.randn(B, T, D, generator=torch.Generator().manual_seed(7))
NEG = float("-inf")
SCALE = 1 / math.sqrt(DH)
RANKS = ("1d", "2d", "3d", "4d", "folded")


# ------------------------------------------------------------------------------------------------ forms
# Each form spells the five steps of attention: scores = q k^T, scaled, masked (``allowed``: True = may attend),
# softmax over the keys, weights @ V. ``lead`` is the einsum letters of the axes before (query, key), ``vec`` whether
# the query is one vector (scores (key,)). A form returns the masked scores; ``drop_mask`` writes the mask the way
# the form does but throws its result away (the unused-mask bug; None for forms with no result to throw away).
class Form:
    name = "operator"

    def scores(self, q, k, lead, vec):
        return q @ k.transpose(-2, -1)

    def scale(self, s):
        return s * SCALE

    def mask(self, s, allowed):
        return s.masked_fill(~allowed, NEG)

    def drop_mask(self, s, allowed):
        s.masked_fill(~allowed, NEG)

    def softmax(self, s, dim=-1):
        return F.softmax(s, dim=dim)

    def values(self, w, v, lead, vec):
        return w @ v


class Method(Form):
    name = "method"

    def scores(self, q, k, lead, vec):
        return q.matmul(k.mT)

    def scale(self, s):
        return s.div(math.sqrt(DH))

    def softmax(self, s, dim=-1):
        return s.softmax(dim)

    def values(self, w, v, lead, vec):
        return w.matmul(v)


class Keyword(Form):
    name = "keyword"

    def scores(self, q, k, lead, vec):
        return torch.matmul(input=q, other=k.transpose(dim0=-2, dim1=-1))

    def scale(self, s):
        return torch.mul(input=s, other=SCALE)

    def mask(self, s, allowed):
        return s.masked_fill(mask=~allowed, value=-1e9)

    def drop_mask(self, s, allowed):
        s.masked_fill(mask=~allowed, value=-1e9)

    def softmax(self, s, dim=-1):
        return F.softmax(input=s, dim=dim)

    def values(self, w, v, lead, vec):
        return torch.matmul(input=w, other=v)


class Function(Form):
    name = "function"

    def scores(self, q, k, lead, vec):
        return torch.matmul(q, torch.transpose(k, -2, -1))

    def scale(self, s):
        return torch.div(s, math.sqrt(DH))

    def mask(self, s, allowed):
        return torch.masked_fill(s, ~allowed, NEG)

    def drop_mask(self, s, allowed):
        torch.masked_fill(s, ~allowed, NEG)

    def softmax(self, s, dim=-1):
        return torch.softmax(s, dim)

    def values(self, w, v, lead, vec):
        return torch.matmul(w, v)


class Unbound(Form):
    name = "unbound"

    def scores(self, q, k, lead, vec):
        return torch.Tensor.matmul(q, torch.Tensor.transpose(k, -2, -1))

    def scale(self, s):
        return torch.Tensor.mul(s, SCALE)

    def mask(self, s, allowed):
        return torch.Tensor.masked_fill(s, ~allowed, NEG)

    def drop_mask(self, s, allowed):
        torch.Tensor.masked_fill(s, ~allowed, NEG)

    def softmax(self, s, dim=-1):
        return torch.Tensor.softmax(s, dim)

    def values(self, w, v, lead, vec):
        return torch.Tensor.matmul(w, v)


class InPlace(Form):
    name = "in-place"

    def scale(self, s):
        s /= math.sqrt(DH)
        return s

    def mask(self, s, allowed):
        s.masked_fill_(~allowed, NEG)
        return s

    def drop_mask(self, s, allowed):  # the out-of-place spelling next to the in-place one, result dropped
        s.masked_fill(~allowed, NEG)


class InPlaceKeyword(InPlace):
    name = "in-place keyword"

    def scale(self, s):
        return s.mul_(other=SCALE)

    def mask(self, s, allowed):
        return torch.Tensor.masked_fill_(s, mask=~allowed, value=NEG)


class Out(Form):
    """``out=`` buffers, and ``out=`` the input (an in-place write by another name)."""

    name = "out="

    def scores(self, q, k, lead, vec):
        if vec:
            return torch.mv(k, q, out=torch.empty(k.shape[0]))
        return torch.matmul(q, k.mT, out=torch.empty(*q.shape[:-1], k.shape[-2]))

    def scale(self, s):
        return torch.mul(s, SCALE, out=s)

    def mask(self, s, allowed):
        return torch.add(s, torch.zeros(allowed.shape).masked_fill(~allowed, NEG), out=s)

    def drop_mask(self, s, allowed):
        torch.add(s, torch.zeros(allowed.shape).masked_fill(~allowed, NEG))

    def values(self, w, v, lead, vec):
        if vec:
            return torch.mv(v.T, w, out=torch.empty(v.shape[-1]))
        return torch.matmul(w, v, out=torch.empty(*w.shape[:-1], v.shape[-1]))


class Products(Form):
    """mm for 2-D, bmm for 3-D, mv for a query vector (``K @ q`` and ``V^T @ w``)."""

    name = "mm/bmm/mv"

    def scores(self, q, k, lead, vec):
        if vec:
            return torch.mv(k, q)
        return {0: torch.mm, 1: torch.bmm}.get(len(lead), torch.matmul)(q, k.transpose(-2, -1))

    def values(self, w, v, lead, vec):
        if vec:
            return torch.mv(v.T, w)
        return {0: torch.mm, 1: torch.bmm}.get(len(lead), torch.matmul)(w, v)


class Einsum(Form):
    name = "einsum"

    def scores(self, q, k, lead, vec):
        return torch.einsum(f"{lead}{'' if vec else 'q'}d,{lead}kd->{lead}{'' if vec else 'q'}k", q, k)

    def values(self, w, v, lead, vec):
        qa = "" if vec else "q"
        return torch.einsum(f"{lead}{qa}k,{lead}ke->{lead}{qa}e", w, v)


class EinsumList(Einsum):
    name = "einsum list"

    def scores(self, q, k, lead, vec):  # (k, q) order, operands in one list
        qa = "" if vec else "q"
        return torch.einsum(f"{lead}kd,{lead}{qa}d->{lead}{qa}k", [k, q])

    def values(self, w, v, lead, vec):
        qa = "" if vec else "q"
        return torch.einsum(f"{lead}{qa}k,{lead}ke->{lead}{qa}e", [w, v])


class Additive(Form):
    """A float mask added to the scores, and ``scores += mask`` in place."""

    name = "additive"

    def mask(self, s, allowed):
        return s + (~allowed).float() * -1e9

    def drop_mask(self, s, allowed):
        s.add((~allowed).float() * -1e9)


class AddInPlace(Additive):
    name = "add in place"

    def mask(self, s, allowed):
        s += torch.zeros(allowed.shape).masked_fill(~allowed, NEG)
        return s


class Where(Form):
    name = "where"

    def mask(self, s, allowed):
        return torch.where(condition=allowed, input=s, other=torch.finfo(s.dtype).min)

    def drop_mask(self, s, allowed):
        torch.where(allowed, s, NEG)


class WhereMethod(Form):
    name = "where method"

    def mask(self, s, allowed):
        return s.where(allowed, NEG)

    def drop_mask(self, s, allowed):
        s.where(allowed, NEG)


class SetItem(Form):
    name = "setitem"

    def mask(self, s, allowed):
        s[~allowed.expand(s.shape)] = NEG
        return s

    drop_mask = None


class ModuleSoftmax(Form):
    name = "nn.Softmax"

    def softmax(self, s, dim=-1):
        return nn.Softmax(dim=dim)(s)


FORMS = {
    f.name: f
    for f in (
        Form(),
        Method(),
        Keyword(),
        Function(),
        Unbound(),
        InPlace(),
        InPlaceKeyword(),
        Out(),
        Products(),
        Einsum(),
        EinsumList(),
        Additive(),
        AddInPlace(),
        Where(),
        WhereMethod(),
        SetItem(),
        ModuleSoftmax(),
    )
}


# ------------------------------------------------------------------------------------------------ the module
class Attention(nn.Module):
    """One attention at one rank in one form; ``bug`` is one classic mistake or None."""

    def __init__(self, rank: str, form: Form, bug: str | None = None):
        super().__init__()
        heads = H if rank in ("4d", "folded") else 1
        self.q, self.k, self.v = (nn.Linear(D, heads * DH, bias=False) for _ in range(3))
        self.rank, self.form, self.bug, self.heads = rank, form, bug, heads

    def qkv(self, x):
        """q, k, v laid out for the rank, and the einsum letters of their lead axes."""
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, T, heads * DH)
        if self.rank == "1d":  # the last token's query against every key of the first sequence
            return q[0, -1], k[0], v[0], ""
        if self.rank == "2d":
            return q[0], k[0], v[0], ""
        if self.rank == "3d":
            return q, k, v, "b"
        q, k, v = (t.view(B, T, H, DH).transpose(1, 2) for t in (q, k, v))  # (B, H, T, DH)
        if self.rank == "4d":
            return q, k, v, "bh"
        return q.reshape(B * H, T, DH), k.reshape(B * H, T, DH), v.reshape(B * H, T, DH), "n"

    def forward(self, x, allowed):
        form, vec = self.form, self.rank == "1d"
        q, k, v, lead = self.qkv(x)
        s = form.scale(form.scores(q, k, lead, vec))
        if self.bug == "unused_mask":
            form.drop_mask(s, allowed)
        else:
            s = form.mask(s, allowed)
        w = form.softmax(s, dim=-2 if self.bug == "softmax_axis" else -1)
        out = form.values(w, k if self.bug == "same_kv" else v, lead, vec)
        if self.rank == "folded":
            out = out.view(B, H, T, DH)
        if self.rank in ("folded", "4d"):
            if self.bug == "head_merge":
                return out.reshape(B, T, D)
            return out.transpose(1, 2).reshape(B, T, D)
        return out


def inputs(rank):
    """The allowed mask each rank is given: causal for query rows, key padding for one query vector."""
    if rank == "1d":
        return torch.tensor([False, True, True, True, True])  # left padding
    return torch.ones(T, T, dtype=torch.bool).tril()


def expected_qkv(model, rank):
    """q, k, v in the record layout (batch, head, query/key, d), computed here from the module's own weights."""
    q, k, v = model.q(X), model.k(X), model.v(X)
    if rank == "1d":
        return q[0, -1][None, None, None], k[0][None, None], v[0][None, None]
    if rank == "2d":
        return q[0][None, None], k[0][None, None], v[0][None, None]
    if rank == "3d":
        return q[:, None], k[:, None], v[:, None]
    return tuple(t.view(B, T, H, DH).transpose(1, 2) for t in (q, k, v))


def expected_allowed(rank):
    allowed = inputs(rank)
    return allowed[None, None, None] if rank == "1d" else allowed.expand(1 if rank == "2d" else B, 1, T, T)


def capture(model, allowed):
    torch.manual_seed(0)
    with torch.no_grad():
        plain = model(X, allowed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with attnprobe.capture(model, modules=[model]) as cap:
                got = model(X, allowed)
    torch.testing.assert_close(got, plain, rtol=0, atol=0, equal_nan=True, msg="capture changed the model's output")
    assert leftovers(model) == []
    return cap, [w for w in caught if issubclass(w.category, attnprobe.AttnprobeWarning)]


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("form", FORMS)
def test_correct_attention_is_read_whole_in_every_form_and_rank(form, rank):
    torch.manual_seed(1)
    model = Attention(rank, FORMS[form]).eval()
    cap, warned = capture(model, inputs(rank))
    assert [str(w.message) for w in warned] == []
    (rec,) = cap
    assert rec.identified == ALL, rec.meta.get("missing")
    assert rec.meta["lint"] == ()
    assert rec.num_heads == (H if rank in ("4d", "folded") else 1)
    q, k, v = expected_qkv(model, rank)
    with torch.no_grad():
        torch.testing.assert_close(rec.q, q, rtol=0, atol=1e-6)
        torch.testing.assert_close(rec.k, k, rtol=0, atol=1e-6)
        torch.testing.assert_close(rec.v, v, rtol=0, atol=1e-6)
    assert rec.scaling == pytest.approx(SCALE)
    allowed = rec.allowed_for_heads()
    assert torch.equal(allowed, expected_allowed(rank).expand_as(allowed))
    torch.testing.assert_close(rec.scores, rec.q @ rec.k.transpose(-2, -1) * rec.scaling, rtol=0, atol=1e-5)
    torch.testing.assert_close(rec.weights, reference_weights(rec.q, rec.k, rec.scaling, allowed), rtol=0, atol=1e-6)
    torch.testing.assert_close(rec.output, rec.weights @ rec.v, rtol=0, atol=1e-6)
    assert rec.kind == "self" and rec.causal is True
    if rank == "1d":  # one query row: the last token's, after the keys before it (nothing is in its future)
        assert rec.weights.shape == (1, 1, 1, T) and rec.output.shape == (1, 1, 1, DH) and rec.query_offset == T - 1
        assert "one query vector" in rec.meta["query_vector"]
    result = attnprobe.check(cap)
    assert result.ok, result.table()
    assert [s.split(":")[0] for s in result.skipped] == (["padding"] if rank == "1d" else []), result.skipped


BUGS = {
    "unused_mask": "lint_unused_mask",
    "same_kv": "lint_same_kv",
    "softmax_axis": "lint_softmax_axis",
    "head_merge": "lint_head_merge",
}


#: Each bug in every form, at two ranks each, so that every rank meets a bug: a query vector has only the key axis
#: (no softmax_axis bug) and one head nothing to merge (head_merge at 4-D and folded only).
BUG_RANKS = {
    "unused_mask": ("1d", "4d"),
    "same_kv": ("1d", "3d"),
    "softmax_axis": ("2d", "4d"),
    "head_merge": ("4d", "folded"),
}


def _bug_cases():
    for form in FORMS:
        for bug, ranks in BUG_RANKS.items():
            if bug == "unused_mask" and FORMS[form].drop_mask is None:
                continue  # ``s[index] = -inf`` has no result to throw away
            for rank in ranks:
                yield form, rank, bug


@pytest.mark.parametrize("form, rank, bug", list(_bug_cases()))
def test_each_classic_bug_is_flagged_in_every_form_and_rank(form, rank, bug):
    torch.manual_seed(1)
    model = Attention(rank, FORMS[form], bug=bug).eval()
    cap, warned = capture(model, inputs(rank))
    (rec,) = cap
    assert [v.check for v in rec.meta["lint"]] == [BUGS[bug]]
    assert [str(w.message).split(":")[0] for w in warned] == [f"{BUGS[bug]} in layer 0 ('')"]
    if bug == "unused_mask":  # the code really attends every key, and the record says so
        assert rec.allowed.all() and rec.identified == ALL


# ------------------------------------------------------------------------------------------------ the issue's cases
def test_one_query_vector_as_every_tutorial_starts():
    torch.manual_seed(3)
    query, keys, values = torch.randn(8), torch.randn(6, 8), torch.randn(6, 3)

    class Tutorial(nn.Module):
        def forward(self, query, keys, values):
            d_k = keys.shape[-1]
            return torch.softmax(query @ keys.T / d_k**0.5, dim=0) @ values

    model = Tutorial()
    with attnprobe.capture(model, modules=[model]) as cap:
        out = model(query, keys, values)
    (rec,) = cap
    assert rec.identified == ALL and rec.num_heads == 1 and rec.kind == "cross"
    assert torch.equal(rec.q, query[None, None, None]) and torch.equal(rec.k, keys[None, None])
    assert torch.equal(rec.v, values[None, None]) and torch.equal(rec.output, out[None, None, None])
    assert rec.weights.shape == (1, 1, 1, 6) and rec.scaling == pytest.approx(8**-0.5)
    assert attnprobe.check(cap).ok


def test_keyword_mask_from_the_issue_gives_the_whole_record_and_its_bug():
    class Keywords(nn.Module):
        def __init__(self, drop=False):
            super().__init__()
            self.qkv, self.drop = nn.Linear(D, 3 * D), drop

        def forward(self, x, m):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            scores = q @ k.transpose(-2, -1) / math.sqrt(D)
            if self.drop:
                scores.masked_fill(mask=m, value=-1e9)
            else:
                scores = scores.masked_fill(mask=m, value=-1e9)
            return F.softmax(scores, dim=-1) @ v

    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    cap, warned = capture(Keywords().eval(), future)
    (rec,) = cap
    assert rec.identified == ALL and rec.causal is True and warned == []
    assert rec.scores.max() < 100  # the scores before the fill value
    result = attnprobe.check(cap)
    assert "softmax_match" in result.coverage and "output_match" in result.coverage and result.skipped == ()
    cap, warned = capture(Keywords(drop=True).eval(), future)
    assert [v.check for v in cap[0].meta["lint"]] == ["lint_unused_mask"]


class LuongDot(nn.Module):
    """Seq2seq dot attention: each decoder state is one query vector over the encoder's outputs (keys and values by
    design), the scores made as a column and squeezed, the weights unsqueezed for the product with the values."""

    def __init__(self, heads: bool = False):
        super().__init__()
        self.heads = heads

    def forward(self, hidden, encoder_outputs, source_mask):
        if self.heads:  # hidden (B, H, d), encoder_outputs (B, H, S, d)
            scores = (encoder_outputs @ hidden.unsqueeze(-1)).squeeze(-1)  # (B, H, S)
            w = scores.masked_fill(~source_mask[:, None], NEG).softmax(-1)
            return (w.unsqueeze(-2) @ encoder_outputs).squeeze(-2)  # (B, H, d)
        scores = torch.bmm(encoder_outputs, hidden.unsqueeze(2)).squeeze(2)  # (B, S)
        w = F.softmax(scores.masked_fill(mask=~source_mask, value=NEG), dim=1)
        return torch.bmm(w.unsqueeze(1), encoder_outputs).squeeze(1)  # (B, d)


@pytest.mark.parametrize("heads", [False, True], ids=["bmm", "matmul with heads"])
def test_query_vectors_as_columns_in_seq2seq_dot_attention(heads):
    torch.manual_seed(4)
    lead = (B, H) if heads else (B,)
    hidden, enc = torch.randn(*lead, DH), torch.randn(*lead, T, DH)
    source_mask = torch.tensor([[True] * T, [True] * 3 + [False] * 2])
    model = LuongDot(heads)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with attnprobe.capture(model, modules=[model]) as cap:
            out = model(hidden, enc, source_mask)
    assert [str(w.message) for w in caught] == []  # encoder outputs as keys and values: no lint_same_kv
    (rec,) = cap
    heads_of = (lambda t: t) if heads else (lambda t: t[:, None])
    assert rec.identified == ALL and rec.num_heads == (H if heads else 1) and rec.scaling == 1.0
    assert torch.equal(rec.q, heads_of(hidden).unsqueeze(-2)) and torch.equal(rec.k, heads_of(enc))
    assert torch.equal(rec.v, heads_of(enc)) and torch.equal(rec.output, heads_of(out).unsqueeze(-2))
    assert torch.equal(rec.allowed_for_heads()[:, 0, 0], source_mask)
    torch.testing.assert_close(rec.weights, reference_weights(rec.q, rec.k, 1.0, rec.allowed_for_heads()))


# ------------------------------------------------------------------------------------------------ partial records
class Distances(nn.Module):
    """Scores that are no q @ k product (negative distances), used by two calls in one forward."""

    def forward(self, x):
        scores = torch.cdist(x, x).neg()  # the line the warning names
        out = x
        for _ in range(2):
            out = F.softmax(scores, dim=-1) @ out
        return out


def test_a_partial_record_warns_once_per_layer_naming_fields_and_line():
    model = Distances()
    with pytest.warns(attnprobe.AttnprobeWarning) as caught:  # noqa: PT031  (two calls, one warning)
        with attnprobe.capture(model, modules=[model]) as cap:
            model(X)
            model(X)
    missing = [w for w in caught if "the record has no" in str(w.message)]
    line = Distances.forward.__code__.co_firstlineno + 1
    assert len(missing) == 1 and len(cap) == 4  # one layer, four calls: one warning
    message = str(missing[0].message)
    assert "layer 0 (''): the record has no q, k, v, output, allowed" in message
    assert f"neg(...) at test_torch_forms.py:{line}" in message and "CheckResult.skipped" in message
    assert missing[0].filename == __file__
    assert set(cap[0].meta["missing"]) == {"q", "k", "v", "output", "allowed"}
    assert attnprobe.check(cap).skipped  # and check says what it skipped


class EllipsisValues(nn.Module):
    """Scores read fully, values taken by an einsum with '...' (not read): v and output are missing."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        w = (q @ k.mT * SCALE).softmax(-1)
        return torch.einsum("...qk,...kd->...qd", w, v)


def test_a_record_missing_only_values_says_where_the_weights_went():
    model = EllipsisValues().eval()
    with pytest.warns(
        attnprobe.AttnprobeWarning,
        match=r"the record has no v, output: the weights of softmax at "
        r"test_torch_forms.py:\d+ do not reach a product with values .*used by einsum\(\.\.\.\) at "
        r"test_torch_forms.py:\d+",
    ):
        with attnprobe.capture(model, modules=[model]) as cap:
            model(X)
    assert cap[0].identified == ALL - {"v", "output"}


# ------------------------------------------------------------------------------------------------ the normaliser
S = torch.randn(2, 3, 3)
M = torch.ones(3, 3, dtype=torch.bool).tril()
_T = torch.Tensor


@pytest.mark.parametrize(
    "func, args, kwargs, op, params",
    [
        (_T.masked_fill, (S,), {"mask": M, "value": -1.0}, "masked_fill", {"input": S, "mask": M, "value": -1.0}),
        (torch.masked_fill, (S, M, -1.0), {}, "masked_fill", {"input": S, "mask": M, "value": -1.0}),
        (_T.where, (S, M, 0.0), {}, "where", {"condition": M, "input": S, "other": 0.0}),
        (
            torch.where,
            (),
            {"condition": M, "input": S, "other": 0.0},
            "where",
            {"condition": M, "input": S, "other": 0.0},
        ),
        (torch.mm, (), {"input": S[0], "mat2": S[1]}, "matmul", {"input": S[0], "other": S[1]}),
        (torch.mv, (S[0], S[0, 0]), {}, "matmul", {"input": S[0], "other": S[0, 0]}),
        (_T.__rmatmul__, (S, S[0]), {}, "matmul", {"input": S[0], "other": S}),
        (_T.__rsub__, (S, 1), {}, "sub", {"input": 1, "other": S, "alpha": 1}),
        (torch.dropout, (S, 0.1), {"train": False}, "dropout", {"input": S, "p": 0.1, "training": False}),
        (
            F.softmax,
            (S,),
            {"dim": -1, "_stacklevel": 3, "dtype": None},
            "softmax",
            {"input": S, "dim": -1, "_stacklevel": 3, "dtype": None},
        ),
        (_T.swapaxes, (S,), {"axis0": 1, "axis1": 2}, "permute", {"input": S, "dims": (0, 2, 1)}),
        (_T.permute, (S, 2, 0, 1), {}, "permute", {"input": S, "dims": (2, 0, 1)}),
        (torch.permute, (S,), {"dims": [2, 0, 1]}, "permute", {"input": S, "dims": (2, 0, 1)}),
        (torch.movedim, (S, 0, -1), {}, "permute", {"input": S, "dims": (1, 2, 0)}),
        (torch.einsum, ("bqd->bdq", S), {}, "permute", {"input": S, "dims": (0, 2, 1)}),
        (torch.einsum, ("bij,bjk->bik", [S, S]), {}, "einsum", {"equation": "bij,bjk->bik", "operands": (S, S)}),
        (
            torch.repeat_interleave,
            (),
            {"input": S, "repeats": 2, "dim": 1},
            "repeat_interleave",
            {"input": S, "repeats": 2, "dim": 1},
        ),
        (
            torch.baddbmm,
            (S, S, S),
            {"alpha": 0.5},
            "baddbmm",
            {"input": S, "batch1": S, "batch2": S, "alpha": 0.5, "beta": 1},
        ),
    ],
)
def test_every_calling_form_is_read_by_the_ops_own_signature(func, args, kwargs, op, params):
    call = read_call(func, args, kwargs)
    assert call.op == op
    assert set(call.params) == set(params)
    for name, want in params.items():
        got = call.params[name]
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want), name
        elif isinstance(want, tuple) and want and isinstance(want[0], torch.Tensor):
            assert all(g is w for g, w in zip(got, want, strict=True)), name
        else:
            assert got == want, name
    assert func(*args, **kwargs) is not None  # the form is one torch itself accepts


def test_in_place_and_out_are_known_to_overwrite_the_input():
    assert read_call(_T.masked_fill_, (S, M, 0.0), {}).inplace
    assert not read_call(_T.masked_fill, (S, M, 0.0), {}).inplace
    buf = torch.empty(2, 3, 3)
    assert read_call(torch.add, (S, S), {"out": S}).inplace
    call = read_call(torch.add, (S, S), {"out": buf})
    assert not call.inplace and call.out is buf and "out" not in call.params
    assert read_call(_T.__iadd__, (S, S), {}).inplace  # ``s += m``, should a release hand the operator over as it is
    assert read_call(torch.cdist, (S, S), {}).op == "other"
