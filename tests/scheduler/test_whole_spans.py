"""Gemma 3's images, whose tokens attend to one another (PromptImages.whole_spans): chunked
prefill never cuts one (a chunk that would end inside an image ends before it, and the image
runs whole in a later step), and a cached prefix never ends inside one (it ends at the page
before the image, which runs again whole); the rest of the prompt is chunked and cached as
always. Pages of 4 tokens: images of 10 fall across page edges."""
import dataclasses

from tests.scheduler.fake_model import PAGE, FakeModel, make_scheduler, req


@dataclasses.dataclass(frozen=True)
class Images:
    """What the scheduler reads of a request's PromptImages (runtime/executor/image_rows.py)."""

    cache_key: list
    whole_spans: tuple


def with_images(rid, prompt, spans, **kw):
    key = list(prompt)
    for first, last in spans:
        key[first:last] = [-1 - first] * (last - first)  # each image its own key
    return req(rid, prompt=list(prompt), prompt_images=Images(key, tuple(spans)), **kw)


PROMPT = list(range(60, 90))  # 30 tokens
SPANS = ((5, 15), (17, 27))  # two images of 10


def prompt_chunks(batch):
    return [(r.rid, c.num_cached, c.num_cached + len(c.token_ids))
            for r, c in zip(batch.requests, batch.chunks) if c.num_cached < len(r.prompt_ids)]


def chunks_of(model):
    return [chunk[1:] for b in model.batches for chunk in prompt_chunks(b)]


def test_no_chunk_ends_inside_an_image():
    s = make_scheduler(chunk=12, budget=12)
    model = FakeModel(s)
    s.add(with_images("a", PROMPT, SPANS))
    done = model.run_all()[0]
    # 12-token chunks, each cut before the image it would end in; the images run whole.
    assert chunks_of(model) == [(0, 5), (5, 17), (17, 29), (29, 30)]
    plain = make_scheduler(chunk=12, budget=12)
    plain_model = FakeModel(plain)
    plain.add(req("a", prompt=PROMPT))
    assert plain_model.run_all()[0].output_ids == done.output_ids


def test_an_image_waits_for_a_step_with_room_for_all_of_it():
    """Two prompts share a step's 12 tokens: the second's image does not fit beside the first's
    chunk, so it runs in the next step, whole (beside the first's decode: 11 tokens)."""
    s = make_scheduler(chunk=12, budget=12)
    model = FakeModel(s)
    s.add(req("text", prompt=list(range(60, 68))))
    s.add(with_images("image", list(range(70, 85)), ((2, 12),)))
    model.run_all()
    steps = [prompt_chunks(b) for b in model.batches]
    assert steps[0] == [("text", 0, 8), ("image", 0, 2)]
    assert steps[1] == [("image", 2, 13)]


def test_a_cached_prefix_that_would_end_inside_an_image_ends_before_it():
    """A prompt ending 2 tokens after its image (10..20, 22 tokens): its reusable whole pages
    end at 20, inside the image: it starts at 8, the page before the image, and runs the image
    again whole. The same prompt with a longer tail reuses the image's pages."""
    s = make_scheduler(chunk=32, budget=32)
    model = FakeModel(s)
    first = with_images("first", list(range(60, 90)), ((10, 21),))
    s.add(first)
    model.run_all()
    short = with_images("short", list(range(60, 83)), ((10, 21),))
    s.add(short)
    batch = s.schedule()
    assert batch.chunks[0].num_cached == 8 == short.num_cached_prompt_tokens
    s.process_results(batch, model.step(batch))
    model.run_all()
    again = with_images("again", list(range(60, 90)), ((10, 21),))
    s.add(again)
    batch = s.schedule()
    assert batch.chunks[0].num_cached == (30 - 1) // PAGE * PAGE
    s.process_results(batch, model.step(batch))
    model.run_all()


def test_a_prompt_without_spans_is_cut_and_cached_as_before():
    r = with_images("a", PROMPT, ())
    assert r.whole_span_end(0, 7) == 7
    r = with_images("b", PROMPT, SPANS)
    assert [r.whole_span_end(0, end) for end in (5, 6, 15, 16, 20, 27)] == [5, 5, 15, 16, 17, 27]
    assert r.whole_span_end(5, 12) == 5  # an image from the start that does not fit: nothing
