"""RunningSamples, the router's record of the running samples of its n > 1 requests: a
sample's id is "i_<parent>" whatever the parent id holds (underscores too), an id that
only looks numeric names no sample, and a sample ends once."""

from __future__ import annotations

from jaxkv import SamplingParams
from jaxkv.router_samples import RunningSamples
from tests.sharding._router_util import make_router


def test_a_parent_id_with_underscores_names_its_samples():
    samples = RunningSamples()
    samples.add("a_b", 2)
    samples.add("1_c", 3)  # a parent id that itself looks like a sample id
    assert samples.sample_of("1_a_b") == ("a_b", 1) and "0_a_b" in samples
    assert samples.sample_of("2_1_c") == ("1_c", 2)
    assert samples.sample_of("2_a_b") is None and "b" not in samples
    assert samples.end("a_b", 1) and samples.sample_of("1_a_b") is None


def test_digits_that_are_not_ascii_name_no_sample():
    samples = RunningSamples()
    samples.add("x", 3)
    # str.isdigit is True for these, but int() refuses "²" and reads "١" (Arabic) as 1.
    for request_id in ("²_x", "١_x", "¹_x"):
        assert samples.sample_of(request_id) is None and request_id not in samples
    assert samples.sample_of("1_x") == ("x", 1)


def test_a_sample_ends_once():
    samples = RunningSamples()
    samples.add("x", 2)
    assert samples.end("x", 1) and samples.running("x") == [0]
    assert not samples.end("x", 1)  # already ended: counted once
    assert not samples.end("x", 5) and not samples.end("y", 0)
    assert samples.num_running("x") == 1 and samples.pop("x") == 1


def test_running_lists_indices_in_order_and_an_id_without_underscore_names_no_sample():
    samples = RunningSamples()
    samples.add("", 3)  # even an empty parent id: its samples are "0_" ... "2_"
    assert samples.running("") == [0, 1, 2] and samples.sample_of("2_") == ("", 2)
    assert samples.sample_of("2") is None and "1" not in samples
    samples.add("x", 12)
    for i in (0, 5, 11):
        samples.end("x", i)
    assert samples.running("x") == [1, 2, 3, 4, 6, 7, 8, 9, 10] and samples.running("y") == []


def test_an_object_that_is_no_str_names_no_sample():
    samples = RunningSamples()
    samples.add("x", 2)
    for request_id in (0, None, b"0_x", ["0_x"]):  # `in` is asked of any object
        assert samples.sample_of(request_id) is None and request_id not in samples


def test_an_index_of_more_digits_than_int_reads_names_no_sample():
    # int() refuses a str of over 4300 digits (sys.get_int_max_str_digits): such an id
    # raised ValueError from router.abort (and add_request) instead of naming no sample.
    samples = RunningSamples()
    samples.add("x", 3)
    for request_id in ("1" * 5000 + "_x", "1" * 19 + "_x", "0" * 5000 + "1_x"):
        assert samples.sample_of(request_id) is None and request_id not in samples
    assert samples.sample_of("2_x") == ("x", 2)


def test_a_router_takes_and_aborts_an_id_whose_sample_index_has_too_many_digits():
    router, _ = make_router(2)
    router.add_request([1] * 4, SamplingParams(n=2, max_tokens=3), request_id="x")
    long_id = "1" * 5000 + "_x"
    assert router.abort(long_id) is False
    assert router.add_request([2] * 4, request_id=long_id) == long_id
    assert router.abort(long_id) is True and router.num_outstanding in ((2, 0), (0, 2))
