r"""Specification of the pattern language: source regexes, target templates and their reversal."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from surgery.errors import PatternError, SurgeryError
from surgery.patterns import compile_source, lazy_compilation, parse_target, reverse_pair
from surgery.registry import get_checkpoint_conversion_mapping, list_checkpoint_conversion_keys

# --------------------------------------------------------------------------- source patterns


def test_source_is_a_regex_found_anywhere_in_the_key():
    sp = compile_source(r"self_attn\.(q|k)_proj")
    m = sp.regex.search("model.layers.0.self_attn.k_proj.weight")
    assert m is not None
    assert m.group(sp.user_groups[0]) == "k"


def test_star_matches_one_run_of_digits_and_captures_it():
    sp = compile_source("mlp.experts.*.w1.weight")
    m = sp.regex.search("model.layers.0.mlp.experts.17.w1.weight")
    assert m is not None
    assert m.group(sp.star_groups[0]) == "17"
    assert sp.regex.search("model.layers.0.mlp.experts.shared.w1.weight") is None


def test_star_after_a_literal_is_the_wildcard_too():
    sp = compile_source("ngram_embedding.shard_*.weight")
    m = sp.regex.search("model.ngram_embedding.shard_3.weight")
    assert m is not None
    assert m.group(sp.star_groups[0]) == "3"


def test_dot_star_escaped_dot_keeps_its_regex_meaning():
    sp = compile_source(r"model.*\.weight")
    assert not sp.has_star
    assert sp.regex.search("model.anything.at.all.weight") is not None


def test_star_after_a_group_is_a_regex_quantifier():
    sp = compile_source(r"(ab)*.c")
    assert not sp.has_star
    assert sp.regex.search("ababxc") is not None


def test_wildcards_and_user_groups_are_numbered_separately():
    sp = compile_source(r"layers\.(\d+)\.experts.*.(w1|w3)")
    m = sp.regex.search("model.layers.4.experts.12.w3.weight")
    assert m is not None
    assert [m.group(g) for g in sp.user_groups] == ["4", "w3"]
    assert [m.group(g) for g in sp.star_groups] == ["12"]


def test_a_pattern_ending_in_a_name_only_matches_a_whole_name():
    sp = compile_source("q_proj.weight")
    assert sp.regex.search("layers.0.q_proj.weight") is not None
    assert sp.regex.search("layers.0.q_proj.weight_scale_inv") is None
    assert sp.regex.search("layers.0.q_proj.weights") is None


def test_a_pattern_ending_in_a_dot_or_underscore_has_no_name_boundary():
    assert compile_source(r"hc_").regex.search("layers.0.hc_fn") is not None


def test_caret_anchors_at_the_start_of_the_key():
    sp = compile_source(r"^model\.")
    assert sp.anchored
    assert sp.regex.search("model.layers.0") is not None
    assert sp.regex.search("lm.model.layers.0") is None


@pytest.mark.parametrize(
    "pattern",
    [
        r"layers\.(\d+",
        r"[abc",
        "(?<name>x)",
        "trailing\\",
        r"(?i)q_proj",
        "a{2,1}",
        "a)",
        "+a",
        "(|*)",
        r"^*a",
        "a**",
        r"(?<=a+)b",
        r"\q",
        "[z-a]",
        "(?P<1>x)",
        r"*\.x",
    ],
    ids=[
        "unbalanced-group",
        "unterminated-class",
        "pcre-named-group",
        "lone-backslash",
        "inline-flag",
        "bad-repeat",
        "unopened-group",
        "nothing-to-repeat",
        "repeat-after-alternation",
        "repeat-after-anchor",
        "multiple-repeat",
        "variable-look-behind",
        "unknown-escape",
        "bad-range",
        "bad-group-name",
        "leading-star",
    ],
)
def test_an_invalid_source_is_a_pattern_error_naming_the_pattern(pattern):
    with pytest.raises(PatternError) as info:
        compile_source(pattern)
    assert repr(pattern) in str(info.value)
    assert isinstance(info.value, SurgeryError)


# Pieces of sources, valid and not; a look-around is opened by one piece and closed by ")".
_REGEX_PIECES = [
    "a",
    "w1",
    "_",
    ".",
    "\\.",
    "*",
    "+",
    "?",
    "*?",
    "(",
    "(?:",
    ")",
    "|",
    "^",
    "$",
    "\\d",
    "\\w",
    "\\b",
    "[0-9]",
    "{2}",
    "{2,1}",
    "(?=x)",
    "(?!",
    "(?<=x)",
    "(?<!",
    "(?P<n>",
    "\\q",
    "]",
]


def _outcome(compile: Callable[[], re.Pattern[str]]) -> str:
    try:
        return compile().pattern
    except PatternError as exc:
        return f"PatternError: {exc}"


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_REGEX_PIECES), min_size=1, max_size=8))
def test_a_source_compiled_lazily_is_accepted_or_refused_as_when_compiled_at_once(pieces):
    pattern = "".join(pieces)
    with lazy_compilation():
        lazily = _outcome(lambda: compile_source(pattern).regex)  # a refusal may come at first use
    at_once = _outcome(lambda: compile_source(pattern).regex)
    assert lazily == at_once  # the same regex, or the same PatternError naming the pattern
    assert at_once.startswith("PatternError") or re.compile(at_once).pattern == compile_source(pattern).body()


def test_a_user_source_that_is_no_regex_is_refused_where_it_is_written():
    pattern = r"layers.\d{2,1}"
    with pytest.raises(PatternError, match=re.escape(f"{pattern!r} is not a valid regex")):
        compile_source(pattern)


def test_inside_lazy_compilation_a_source_that_is_no_regex_is_refused_at_first_use():
    with lazy_compilation():
        sp = compile_source(r"experts.*.w{2,1}")  # it tokenizes; the regex is compiled later
    with pytest.raises(PatternError, match=re.escape("'experts.*.w{2,1}' is not a valid regex")):
        sp.regex.search("experts.0.w1")


def test_every_catalog_source_pattern_and_its_reversal_is_a_valid_regex():
    """The catalogs load under lazy compilation; this is where one of their regexes could fail."""
    checked = 0
    for key in list_checkpoint_conversion_keys():
        for transform in get_checkpoint_conversion_mapping(key):
            for t in (transform, transform.reverse_transform()):
                for source in t.compiled_sources:
                    assert isinstance(source.regex, re.Pattern), (key, source.text)
                    checked += 1
    assert checked > 1000  # the whole built-in catalog, forward and back


def test_a_back_reference_inside_a_source_is_refused():
    with pytest.raises(PatternError, match=r"back-reference"):
        compile_source(r"(a)\.\1")


@pytest.mark.parametrize("pattern", ["", None, 3], ids=["empty", "none", "int"])
def test_a_source_must_be_a_non_empty_string(pattern):
    with pytest.raises(PatternError, match="non-empty string"):
        compile_source(pattern)


def test_brace_quantifiers_are_regex_quantifiers():
    sp = compile_source(r"layers\.\d{1,2}\.mlp")
    assert sp.regex.search("layers.12.mlp") is not None
    assert sp.regex.search("layers.123.mlp") is None


# --------------------------------------------------------------------------- target templates


def test_every_reference_one_to_nine_expands():
    source = compile_source(r"(a)(b)(c)(d)(e)(f)(g)(h)(i)")
    target = parse_target(r"\9\8\7\6\5\4\3\2\1")
    m = source.regex.search("abcdefghi")
    assert m is not None
    groups = tuple(m.group(g) for g in source.user_groups)
    assert target.max_ref == 9
    assert target.expand(groups) == "ihgfedcba"


def test_a_target_is_literal_text_with_escaped_dots_accepted():
    assert parse_target(r"model\.layers").literal == "model.layers"
    assert parse_target("model.layers").literal == "model.layers"


def test_a_target_star_takes_the_captured_index_or_stays_for_the_op_chain():
    target = parse_target("experts.*.gate")
    assert target.n_stars == 1
    assert target.expand((), ("5",)) == "experts.5.gate"
    assert target.expand() == "experts.*.gate"


def test_a_target_caret_and_lookaround_are_kept_only_for_reversal():
    target = parse_target(r"^(?!model\.)model.\1")
    assert target.anchored
    assert target.expand(("x",)) == "model.x"
    assert target.lookarounds == ((0, r"(?!model\.)"),)


@pytest.mark.parametrize(
    "pattern",
    [r"mlp.(gate|up)", r"layers\.\d", "a+b", "a|b", "end$"],
    ids=["group", "class-escape", "quantifier", "alternation", "dollar"],
)
def test_regex_syntax_in_a_target_is_a_pattern_error_naming_it(pattern):
    with pytest.raises(PatternError) as info:
        parse_target(pattern)
    assert repr(pattern) in str(info.value)


# --------------------------------------------------------------------------- reversal


def test_reverse_drops_anchor_and_lookaround_from_what_the_new_target_writes():
    new_source, new_target = reverse_pair(r"^(?!model\.)(.+)", r"model.\1")
    assert new_source == r"^model\.(.+)"
    template = parse_target(new_target)
    assert not template.anchored
    assert template.expand(("layers.0.weight",)) == "layers.0.weight"


def test_reversing_twice_keeps_the_lookaround():
    source, target = r"^model(?!\.(language_model|visual))", "model.language_model"
    again_source, again_target = reverse_pair(*reverse_pair(source, target))
    sp = compile_source(again_source)
    assert sp.regex.search("model.layers.0.weight") is not None
    assert sp.regex.search("model.visual.blocks.0.weight") is None
    assert sp.regex.search("model.language_model.layers.0.weight") is None
    assert parse_target(again_target).expand() == target


def test_reversing_twice_keeps_every_stacked_lookbehind():
    # t5gemma2_encoder: four look-behinds side by side must all survive the round trip.
    source = r"(?<!decoder\.)(?<!text_model\.)(?<!layer)(?<!_)norm\."
    again_source, again_target = reverse_pair(*reverse_pair(source, "text_model.norm."))
    assert again_source == source
    assert again_target == r"text_model\.norm\."
    sp = compile_source(again_source)
    assert sp.regex.search("norm.weight") is not None
    assert sp.regex.search("layers.0.post_feedforward_layernorm.weight") is None
    assert sp.regex.search("layers.0.input_norm.weight") is None
    assert sp.regex.search("decoder.norm.weight") is None


def test_a_lookaround_carried_into_a_source_does_not_shift_group_numbers():
    # The look-around holds a capture group; carried back into a source it must not become \1.
    new_source, new_target = reverse_pair(r"^layers\.(?!(9)\.)(\d+)\.x", r"blocks.\2.y")
    back_source, back_target = reverse_pair(new_source, new_target)
    sp = compile_source(back_source)
    m = sp.regex.search("layers.3.x")
    assert m is not None
    groups = tuple(m.group(g) or "" for g in sp.user_groups)
    assert parse_target(back_target).expand(groups) == "blocks.3.y"
    assert sp.regex.search("layers.9.x") is None


def test_reverse_turns_capture_groups_into_back_references_and_references_into_groups():
    new_source, new_target = reverse_pair(r"layers\.(\d+)\.(q|k)_proj", r"blocks.\1.attn.\2")
    assert new_source == r"blocks\.(\d+)\.attn\.(q|k)"
    assert new_target == r"layers\.\1\.\2_proj"


def test_reverse_renumbers_groups_in_the_order_the_target_uses_them():
    new_source, new_target = reverse_pair(r"(\w+)\.(\d+)\.x", r"\2.\1.y")
    m = re.search(new_source, "3.foo.y")
    assert m is not None and m.groups() == ("3", "foo")
    assert new_target == r"\2\.\1\.x"


def test_reverse_keeps_the_star_a_wildcard_on_both_sides():
    new_source, new_target = reverse_pair("mlp.experts.*.w1", "mlp.experts.*.gate")
    sp = compile_source(new_source)
    m = sp.regex.search("model.mlp.experts.12.gate.weight")
    assert m is not None and m.group(sp.star_groups[0]) == "12"
    assert parse_target(new_target).n_stars == 1


def test_reverse_of_the_reverse_matches_what_the_original_matched():
    source, target = r"layers\.(\d+)\.(q|k)_proj", r"blocks.\1.attn.\2"
    again = reverse_pair(*reverse_pair(source, target))
    for key in ("model.layers.3.q_proj.weight", "x.layers.10.k_proj.bias"):
        assert re.search(compile_source(again[0]).regex, key).group(0) == re.search(source, key).group(0)
    assert again[1] == r"blocks\.\1\.attn\.\2"


def test_reverse_refuses_variable_text_outside_a_group():
    with pytest.raises(PatternError, match=r"outside a capture group"):
        reverse_pair(r"layers\.\d+\.mlp", "blocks.mlp")


def test_reverse_refuses_a_group_the_target_drops():
    with pytest.raises(PatternError, match=r"group \\1 of the source is not used"):
        reverse_pair(r"(\w+)\.mlp", "mlp")


def test_reverse_refuses_a_target_reference_without_a_source_group():
    with pytest.raises(PatternError) as info:
        reverse_pair(r"(\w+)\.mlp", r"\2.mlp")
    assert r"'\\2.mlp'" in str(info.value)


def test_reverse_refuses_a_target_star_not_followed_by_a_dot():
    with pytest.raises(PatternError, match=r"ends with '\*'"):
        reverse_pair("shard_*.weight", "shards.*")
