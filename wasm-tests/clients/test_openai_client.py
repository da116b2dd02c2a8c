"""The official `openai` Python client against Envoy + kvroute + simulated vLLM 0.33 servers
(issue 13): what a typed client sees through the whole stack.

Every response is re-validated with the client's own pydantic types
(`Type.model_validate(resp.model_dump())`) and checked for what vLLM 0.33 guarantees: a
`created` time, ids unique across requests and servers, the assistant role (first in a
stream), `finish_reason` on each choice's last chunk, usage that adds up, one generated token
per streamed chunk. After every test, the gateway and the servers are asked what happened:
kvroute parsed and routed every inference body (no `skipped.*`), and the servers generated
each sequence once (`vllm:request_success_total` rose by exactly the sequences answered).

Run: `make test-clients` (it builds and installs what this needs), or
`.venv/bin/python wasm-tests/clients/test_openai_client.py` from the repository root. The last
line printed is `N passed, N failed`.
"""

import concurrent.futures
import sys
import time
import unittest
from typing import List, Literal, Optional

import openai
from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionChunk

import stack

STACK = stack.Stack()
MODEL = None
# Every response id seen in this run: vLLM's ids are random UUIDs, unique across servers.
IDS = set()
# The simulator's context (Llama 3.1: 131,072 tokens) at its 4-bytes-a-token rule.
OVER_CONTEXT_BYTES = 4 * 140_000
LONG_PROMPT_TOKENS = 20_000


def setUpModule():
    global MODEL
    try:
        STACK.start()
        MODEL = client().models.list().data[0].id
    except BaseException:
        STACK.stop(keep_logs=True)  # unittest skips tearDownModule when this fails
        raise


def tearDownModule():
    STACK.stop(keep_logs=True)  # main() prints them on failure, then removes them


def client(base_url=None):
    # No client retries: a request the gateway or a server got wrong must fail here, not be
    # sent again (that would also hide a request generated twice).
    return openai.OpenAI(base_url=base_url or f"{STACK.gateway}/v1", api_key="unused",
                         max_retries=0, timeout=60.0)


def text_of(tokens, seed):
    """Distinct words making about `tokens` prompt tokens (the simulator's 4 bytes a token):
    a prompt no other test shares a prefix with."""
    out, size, i = [], 0, 0
    while size < 4 * tokens:
        out.append(f"w{seed}x{i}")
        size += len(out[-1]) + 1
        i += 1
    return " ".join(out)


class CompletionChunkChoice(CompletionChoice):
    # The client streams completions as `Completion`, whose choice declares `finish_reason`
    # non-null, yet both OpenAI and vLLM 0.33 (`CompletionResponseStreamChoice`) send null
    # on every chunk but a choice's last; the client builds chunks without validating. Only
    # that field is loosened here: every other field is checked as the client declares it.
    finish_reason: Optional[Literal["stop", "length", "content_filter"]] = None


class CompletionChunk(Completion):
    choices: List[CompletionChunkChoice]


class ThroughTheGateway(unittest.TestCase):
    """Each test counts what it asked for in `self.routed` (inference bodies sent) and
    `self.sequences` (choices the servers must have generated); `tearDown` checks both."""

    def setUp(self):
        self.client = client()
        self.stats = STACK.stats()
        self.success = STACK.fleet_metric("vllm:request_success_total")
        self.routed = 0
        self.sequences = 0
        self.started = int(time.time())

    def tearDown(self):
        # A stack given without its admin or server ports (stack.py) skips these checks.
        if STACK.admin is not None:
            self.check_kvroute()
        if STACK.servers:
            generated = STACK.fleet_metric("vllm:request_success_total") - self.success
            self.assertEqual(generated, self.sequences, "sequences the servers finished (each once)")

    def check_kvroute(self):
        after = STACK.stats()
        delta = {k: after.get(k, 0) - self.stats.get(k, 0) for k in after}
        for skipped in ("skipped.malformed", "skipped.error", "skipped.over_limit"):
            self.assertEqual(delta.get(skipped, 0), 0, f"kvroute {skipped}: {delta}")
        decided = sum(delta.get(f"decision.{d}", 0) for d in ("cold", "prefix_hit", "fallback"))
        self.assertEqual(decided, self.routed, f"kvroute decisions vs inference bodies sent: {delta}")
        # kvroute releases every request's load. The gauge is the sum of each worker's own
        # requests in flight, reported at its ticks (every 100 ms): a request that ended just
        # now may still show, or show only after a read of 0 (the worker reports it once it
        # routed it and again once it ended). So it must read 0 throughout half a second,
        # within 10 s: a leak never clears.
        deadline, quiet_since = time.monotonic() + 10.0, None
        while time.monotonic() < deadline:
            if STACK.stat("inflight_requests") != 0:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= 0.5:
                break
            time.sleep(0.02)
        after = STACK.stats()
        self.assertEqual(after.get("inflight_requests", 0), 0,
                         f"kvroute in-flight requests after the test; its stats: {after}")

    # --- checks shared by every response shape

    def check_envelope(self, resp, kind, obj, chunk=False):
        """Re-validates with the client's type and checks the fields every answer carries."""
        again = kind.model_validate(resp.model_dump())
        self.assertEqual(again.model_dump(), resp.model_dump())
        self.assertEqual(resp.object, obj)
        self.assertEqual(resp.model, MODEL)
        self.assertIsInstance(resp.created, int)
        self.assertTrue(self.started - 1 <= resp.created <= time.time() + 1, f"created {resp.created}")
        if not chunk:
            self.assert_new_id(resp.id)

    def assert_new_id(self, rid):
        prefix = "chatcmpl-" if rid.startswith("chatcmpl-") else "cmpl-"
        self.assertTrue(rid.startswith(prefix) and len(rid) > len(prefix) + 8, rid)
        self.assertNotIn(rid, IDS, "response ids must not repeat")
        IDS.add(rid)

    def check_usage(self, usage, raw, completion_tokens):
        self.assertEqual(usage.completion_tokens, completion_tokens)
        self.assertGreater(usage.prompt_tokens, 0)
        self.assertEqual(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens)
        reported = ((raw or {}).get("usage") or {}).get("prompt_tokens_details") or {}
        if "cached_tokens" in reported:
            self.assertEqual(usage.prompt_tokens_details.cached_tokens, reported["cached_tokens"])
            self.assertLessEqual(usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens)

    def create(self, api, **kw):
        """A non-streaming request: (typed response, raw JSON)."""
        self.routed += 1
        raw = api.with_raw_response.create(model=MODEL, **kw)
        resp = raw.parse()
        self.sequences += len(resp.choices)
        return resp, raw.http_response.json()

    def chat(self, content, **kw):
        return self.create(self.client.chat.completions, messages=[
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": content}], **kw)

    def check_chat(self, resp, raw, n, max_tokens):
        self.check_envelope(resp, ChatCompletion, "chat.completion")
        self.assertEqual(sorted(c.index for c in resp.choices), list(range(n)))
        for c in resp.choices:
            self.assertEqual(c.message.role, "assistant")
            self.assertIsInstance(c.message.content, str)
            self.assertEqual(c.finish_reason, "length")
        self.check_usage(resp.usage, raw, n * max_tokens)

    def stream_chat(self, content, n=1, max_tokens=6, **kw):
        """Streams a chat request; checks the framing; returns (chunks, content chunks per choice)."""
        self.routed += 1
        self.sequences += n
        chunks = list(self.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], n=n,
            max_tokens=max_tokens, stream=True, **kw))
        self.assertTrue(chunks)
        self.assert_new_id(chunks[0].id)
        tokens, finished, roles = {}, {}, {}
        for ch in chunks:
            self.check_envelope(ch, ChatCompletionChunk, "chat.completion.chunk", chunk=True)
            self.assertEqual(ch.id, chunks[0].id, "one id per stream")
            for c in ch.choices:
                self.assertNotIn(c.index, finished, "nothing after a choice's finish_reason")
                if c.delta.role is not None:
                    self.assertNotIn(c.index, tokens, "the role comes before any content")
                    roles[c.index] = c.delta.role
                if c.delta.content:
                    tokens[c.index] = tokens.get(c.index, 0) + 1
                if c.finish_reason is not None:
                    finished[c.index] = c.finish_reason
        self.assertEqual(roles, {i: "assistant" for i in range(n)})
        self.assertEqual(finished, {i: "length" for i in range(n)})
        self.assertEqual(tokens, {i: max_tokens for i in range(n)}, "one token per content chunk")
        return chunks, tokens

    # --- the cases

    def test_models_list_names_the_served_model_with_created(self):
        models = self.client.models.list().data
        self.assertEqual(len(models), 1)
        self.assertEqual(models[0].object, "model")
        self.assertIsInstance(models[0].created, int)
        self.assertEqual(type(models[0]).model_validate(models[0].model_dump()), models[0])

    def test_chat_completion_is_a_valid_chat_completion(self):
        resp, raw = self.chat("Name one prime number.", max_tokens=8)
        self.check_chat(resp, raw, 1, 8)
        # vLLM sends prompt_tokens_details only when some prompt tokens were cached.
        details = raw["usage"].get("prompt_tokens_details")
        if details:
            self.assertEqual(resp.usage.prompt_tokens_details.cached_tokens, details["cached_tokens"])
        else:
            self.assertIsNone(resp.usage.prompt_tokens_details)

    def test_chat_without_max_tokens_stops_by_itself(self):
        resp, raw = self.chat("Say hello.")
        self.check_envelope(resp, ChatCompletion, "chat.completion")
        self.assertEqual(resp.choices[0].finish_reason, "stop")
        self.check_usage(resp.usage, raw, resp.usage.completion_tokens)
        self.assertGreater(resp.usage.completion_tokens, 0)

    def test_chat_with_n_2_returns_two_choices(self):
        resp, raw = self.chat("Two answers please.", n=2, max_tokens=5)
        self.check_chat(resp, raw, 2, 5)

    def test_completion_defaults_to_16_tokens(self):
        resp, raw = self.create(self.client.completions, prompt="Once upon a time")
        self.check_envelope(resp, Completion, "text_completion")
        self.assertEqual(len(resp.choices), 1)
        self.assertEqual(resp.choices[0].finish_reason, "length")
        self.assertIsInstance(resp.choices[0].text, str)
        self.check_usage(resp.usage, raw, 16)

    def test_completion_prompt_list_gives_one_choice_per_prompt_and_sample(self):
        prompts = ["The sky is", "Water boils at", "A triangle has"]
        resp, raw = self.create(self.client.completions, prompt=prompts, n=2, max_tokens=4)
        self.check_envelope(resp, Completion, "text_completion")
        self.assertEqual(sorted(c.index for c in resp.choices), list(range(6)))
        self.assertTrue(all(c.finish_reason == "length" for c in resp.choices))
        self.check_usage(resp.usage, raw, 6 * 4)

    def test_streaming_chat_with_usage_ends_with_a_usage_chunk(self):
        chunks, tokens = self.stream_chat("Count to six.", max_tokens=6,
                                          stream_options={"include_usage": True})
        last = chunks[-1]
        self.assertEqual(last.choices, [])
        self.assertIsNotNone(last.usage)
        self.check_usage(last.usage, None, sum(tokens.values()))
        self.assertTrue(all(ch.usage is None for ch in chunks[:-1]))

    def test_streaming_chat_without_usage_has_no_usage_chunk(self):
        chunks, _ = self.stream_chat("Count to six.", max_tokens=6)
        self.assertTrue(all(ch.usage is None for ch in chunks))
        self.assertTrue(all(ch.choices for ch in chunks))

    def test_streaming_chat_with_n_2_frames_each_choice(self):
        chunks, tokens = self.stream_chat("Two lists.", n=2, max_tokens=4,
                                          stream_options={"include_usage": True})
        self.check_usage(chunks[-1].usage, None, sum(tokens.values()))

    def test_stream_helper_builds_an_assistant_message_the_next_turn_accepts(self):
        # No max_tokens: the helper refuses a `length` finish (LengthFinishReasonError).
        messages = [{"role": "user", "content": "Start a story."}]
        self.routed += 1
        self.sequences += 1
        with self.client.chat.completions.stream(model=MODEL, messages=messages) as s:
            final = s.get_final_completion()
        self.assertEqual(final.choices[0].message.role, "assistant")
        self.assertEqual(final.choices[0].finish_reason, "stop")
        messages += [final.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "Go on."}]
        resp, raw = self.create(self.client.chat.completions, messages=messages, max_tokens=3)
        self.check_chat(resp, raw, 1, 3)

    def test_streaming_completion_has_one_token_per_chunk(self):
        self.routed += 1
        self.sequences += 1
        chunks = list(self.client.completions.create(model=MODEL, prompt="Roses are", max_tokens=7, stream=True,
                                                     stream_options={"include_usage": True}))
        self.assert_new_id(chunks[0].id)
        for ch in chunks:
            self.check_envelope(ch, CompletionChunk, "text_completion", chunk=True)
            if not ch.choices or ch.choices[0].finish_reason:
                Completion.model_validate(ch.model_dump())  # the client's own type, unloosened
            self.assertEqual(ch.id, chunks[0].id)
        text = [ch for ch in chunks if ch.choices and ch.choices[0].text]
        self.assertEqual(text[-1].choices[0].finish_reason, "length")
        self.assertTrue(all(ch.choices[0].finish_reason is None for ch in text[:-1]))
        self.assertEqual(chunks[-1].choices, [])
        self.check_usage(chunks[-1].usage, None, len(text))
        self.assertEqual(len(text), 7)

    def test_tools_request_is_routed_and_answered(self):
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        resp, raw = self.chat("What is the weather in Oslo?", tools=tools, tool_choice="none", max_tokens=6)
        self.check_chat(resp, raw, 1, 6)
        self.assertFalse(resp.choices[0].message.tool_calls)

    def test_unknown_model_is_not_found_with_param_model(self):
        self.routed += 1
        with self.assertRaises(openai.NotFoundError) as caught:
            self.client.chat.completions.create(model="no-such-model", max_tokens=2,
                                                messages=[{"role": "user", "content": "hi"}])
        self.assertEqual(caught.exception.status_code, 404)
        self.assertEqual(caught.exception.param, "model")
        self.assertIn("no-such-model", caught.exception.message)

    def test_over_context_prompt_is_a_fast_bad_request_and_servers_stay_usable(self):
        self.routed += 1
        begun = time.monotonic()
        with self.assertRaises(openai.BadRequestError) as caught:
            self.client.chat.completions.create(model=MODEL, max_tokens=2,
                                                messages=[{"role": "user", "content": "x " * (OVER_CONTEXT_BYTES // 2)}])
        self.assertLess(time.monotonic() - begun, 5.0, "vLLM rejects before any work")
        self.assertEqual(caught.exception.status_code, 400)
        self.assertIn("the model's context length is only", caught.exception.message)
        self.assertEqual(caught.exception.param, "input_tokens")
        # Every server still answers a small request (typed client, straight to the server).
        for port in STACK.servers:
            direct = client(f"http://127.0.0.1:{port}/v1").chat.completions.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "still there?"}])
            self.sequences += 1
            self.check_envelope(direct, ChatCompletion, "chat.completion")

    def test_long_prompt_is_answered_and_its_repeat_is_served_from_cache(self):
        content = text_of(LONG_PROMPT_TOKENS, "long")
        first, raw = self.chat(content, max_tokens=4)
        self.check_chat(first, raw, 1, 4)
        self.assertAlmostEqual(first.usage.prompt_tokens, LONG_PROMPT_TOKENS, delta=LONG_PROMPT_TOKENS * 0.01)
        hits = STACK.stat("decision.prefix_hit")
        again, raw = self.chat(content, max_tokens=4)
        self.check_chat(again, raw, 1, 4)
        # kvroute sends the repeat where the prefix is: the server reports it cached.
        if STACK.admin is not None:
            self.assertEqual(STACK.stat("decision.prefix_hit"), hits + 1)
        self.assertGreater(again.usage.prompt_tokens_details.cached_tokens, 0.9 * again.usage.prompt_tokens)

    def test_sixteen_concurrent_requests_all_succeed_once(self):
        def one(i):
            if i % 2:
                chunks = list(self.client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": text_of(40, f"c{i}")}],
                    max_tokens=8, stream=True, stream_options={"include_usage": True}))
                return chunks[0].id, chunks[-1].usage.completion_tokens
            resp = self.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": text_of(40, f"c{i}")}], max_tokens=8)
            self.check_envelope(resp, ChatCompletion, "chat.completion")
            return None, resp.usage.completion_tokens

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(16)))
        self.routed += 16
        self.sequences += 16
        for rid, _ in results:
            if rid:
                self.assert_new_id(rid)
        self.assertEqual([tokens for _, tokens in results], [8] * 16)


def main():
    started = time.monotonic()
    suite = unittest.defaultTestLoader.loadTestsFromModule(sys.modules[__name__])
    try:
        result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
        failed = len(result.failures) + len(result.errors)
        if failed:
            print(STACK.logs())
    finally:
        STACK.stop()
    passed = max(0, result.testsRun - failed - len(result.skipped))  # a setUpModule error runs none
    print(f"took {time.monotonic() - started:.1f} s")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed or not result.testsRun else 0


if __name__ == "__main__":
    sys.exit(main())
