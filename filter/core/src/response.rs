//! Reading what vLLM reports back: `usage.prompt_tokens_details.cached_tokens`,
//! `usage.prompt_tokens` (and, for traffic capture, `usage.completion_tokens`).
//!
//! The filter does not buffer responses (that would delay every token of a stream); it
//! keeps the last few KiB of the body as it passes and scans them here. `usage` is at the
//! end of a non-streaming body and in the last data event of a stream with
//! `stream_options.include_usage`, so the tail is enough. The scan takes the last
//! `"cached_tokens": <integer>` in the text and ignores anything it cannot read.
//!
//! vLLM writes `prompt_tokens_details` only when started with `--enable-prompt-tokens-details`
//! and only when some prompt tokens were cached: a miss has `usage` without it. So whether
//! `usage` came at all is reported too (`reports_usage`); the router reads "usage without
//! details" as 0 cached from a server that has shown details before.

const CACHED: &[u8] = b"\"cached_tokens\"";
/// Anthropic's `usage.cache_read_input_tokens`, `usage.cache_creation_input_tokens` and
/// `usage.input_tokens` (the prompt less both).
const CACHE_READ: &[u8] = b"\"cache_read_input_tokens\"";
const CACHE_CREATION: &[u8] = b"\"cache_creation_input_tokens\"";
const INPUT: &[u8] = b"\"input_tokens\"";
/// `usage.prompt_tokens`, or the Responses API's `usage.input_tokens`.
const USAGE: [&[u8]; 2] = [b"\"prompt_tokens\"", b"\"input_tokens\""];
/// `usage.completion_tokens`, or the Responses API's `usage.output_tokens`.
const COMPLETION: [&[u8]; 2] = [b"\"completion_tokens\"", b"\"output_tokens\""];

/// Whether `tail` holds a `usage` object (its `prompt_tokens`, or `input_tokens`).
pub fn reports_usage(tail: &[u8]) -> bool {
    USAGE.iter().any(|key| tail.windows(key.len()).any(|w| w == *key))
}

/// The last `cached_tokens` value in `tail`, if one is there whole.
pub fn cached_tokens(tail: &[u8]) -> Option<u64> {
    last_count(tail, CACHED)
}

/// What an answer's usage says, as the router reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// A usage the router can read came (see `reports_usage` for what its absence means).
    pub reported: bool,
    pub cached: Option<u64>,
    /// The prompt's tokens as the server counted them.
    pub prompt: Option<u64>,
}

/// The usage in an answer's `tail`. An Anthropic answer's (`anthropic`: `/v1/messages`, as
/// vLLM translates chat's usage, vllm-project/vllm#40912) has `input_tokens` less the
/// cached ones, which `cache_read_input_tokens` counts; without chat's cache details (no
/// `--enable-prompt-tokens-details`, or nothing cached) the cache fields are absent, and
/// such usage says nothing about the cache the router can use: it counts as not reported,
/// never as a miss (its `input_tokens` is then the whole prompt, which is still learned).
/// Only the last `usage` object is read: a whole answer's `tool_use` input, before it, is
/// raw JSON that may hold any key.
pub fn usage(tail: &[u8], anthropic: bool) -> Usage {
    if anthropic {
        const USAGE_KEY: &[u8] = b"\"usage\"";
        let from = tail.windows(USAGE_KEY.len()).rposition(|w| w == USAGE_KEY).unwrap_or(0);
        let usage = &tail[from..];
        let cached = last_count(usage, CACHE_READ);
        let created = last_count(usage, CACHE_CREATION).unwrap_or(0);
        let prompt = last_count(usage, INPUT).map(|input| input + cached.unwrap_or(0) + created);
        return Usage {
            reported: cached.is_some(),
            cached,
            prompt,
        };
    }
    let reported = reports_usage(tail);
    Usage {
        reported,
        cached: cached_tokens(tail),
        prompt: if reported { prompt_tokens(tail) } else { None },
    }
}

/// The last `usage.prompt_tokens` in `tail`.
pub fn prompt_tokens(tail: &[u8]) -> Option<u64> {
    last_of(tail, USAGE)
}

/// The last `usage.prompt_tokens` and `usage.completion_tokens` in `tail`, when both are there.
pub fn usage_tokens(tail: &[u8]) -> Option<(u64, u64)> {
    Some((last_of(tail, USAGE)?, last_of(tail, COMPLETION)?))
}

/// The value of whichever of `keys` comes last in `tail`.
fn last_of(tail: &[u8], keys: [&[u8]; 2]) -> Option<u64> {
    let at = |key: &[u8]| tail.windows(key.len()).rposition(|w| w == key);
    let key = match (at(keys[0]), at(keys[1])) {
        (Some(a), Some(b)) if b > a => keys[1],
        (None, Some(_)) => keys[1],
        _ => keys[0],
    };
    last_count(tail, key)
}

/// Which servers put `usage` in streams that did not ask for it (vLLM's
/// `--enable-force-include-usage`, for billing), learned from such streams: a server's first
/// one is read (the tail of every chunk, as for a stream that asked), and what its end shows
/// decides whether its later ones are. A server that sends none is tried again every
/// `RETRY_EVERY` such streams (restarted with the flag). Streams cut short teach nothing.
/// A list, not a map: a pool has tens of servers, and a string-keyed B-tree costs the wasm
/// module kilobytes of code (it must fit a 1 MiB ConfigMap).
#[derive(Clone, Debug, Default)]
pub struct ForcedUsage {
    servers: Vec<(String, Habit)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Habit {
    Sends,
    /// Streams that did not ask since the last one read.
    Omits {
        since: u32,
    },
}

impl ForcedUsage {
    /// A server that sent no usage in a stream that did not ask is tried again this often.
    pub const RETRY_EVERY: u32 = 256;
    /// Servers remembered at most (a pool that churns forgets and learns again).
    const MAX_SERVERS: usize = 1024;

    fn habit(&mut self, server: &str) -> Option<&mut Habit> {
        self.servers.iter_mut().find(|(s, _)| s == server).map(|(_, h)| h)
    }

    /// Whether to read the usage of a stream that did not ask for it, sent to `server`.
    pub fn read(&mut self, server: &str) -> bool {
        match self.habit(server) {
            None | Some(Habit::Sends) => true,
            Some(Habit::Omits { since }) => {
                *since += 1;
                if *since >= Self::RETRY_EVERY {
                    *since = 0;
                    return true;
                }
                false
            }
        }
    }

    /// The last bytes (`tail`) of a stream read by `read` that `server` answered with 200.
    /// Returns whether the server's habit changed.
    pub fn learn(&mut self, server: &str, tail: &[u8]) -> bool {
        // A stream vLLM ended with an error (`data: {"error": …}` then `[DONE]`) carries
        // no usage whatever the flag: it says nothing either.
        const ERROR: &[u8] = b"\"error\"";
        if !stream_ended(tail) || tail.windows(ERROR.len()).any(|w| w == ERROR) {
            return false;
        }
        let habit = if reports_usage(tail) {
            Habit::Sends
        } else {
            Habit::Omits { since: 0 }
        };
        let before = match self.habit(server) {
            Some(h) => Some(std::mem::replace(h, habit)),
            None => {
                if self.servers.len() >= Self::MAX_SERVERS {
                    self.servers.clear();
                }
                self.servers.push((server.to_string(), habit));
                None
            }
        };
        before.is_none_or(|b| (b == Habit::Sends) != (habit == Habit::Sends))
    }

    /// Whether `server` is known to send usage unasked.
    pub fn sends(&self, server: &str) -> bool {
        self.servers.iter().any(|(s, h)| s == server && *h == Habit::Sends)
    }
}

/// Whether a stream's last bytes are its normal end (`data: [DONE]`).
fn stream_ended(tail: &[u8]) -> bool {
    let end = tail.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
    tail[..end].ends_with(b"data: [DONE]")
}

/// A Responses stream starts with events sent before any token (`response.created`,
/// `response.in_progress`); its first token comes with its first output event
/// (`response.output_item.added`, then `response.output_text.delta`). Found by its `type`
/// field, quotes included: text the earlier events echo (instructions, tools, metadata)
/// cannot hold it unescaped. A marker cut between two chunks is found in the next event.
pub fn holds_output_event(chunk: &[u8]) -> bool {
    const OUTPUT: &[u8] = b"\"type\":\"response.output_";
    chunk.windows(OUTPUT.len()).any(|w| w == OUTPUT)
}

/// The id of a Responses answer from its first bytes: the first `"id"` string value (a
/// whole response's first field; a stream's first event, `response.created`, holds the
/// response, whose first field it is). `None` until the value is there whole.
pub fn response_id(head: &[u8]) -> Option<String> {
    const ID: &[u8] = b"\"id\"";
    let at = head.windows(ID.len()).position(|w| w == ID)? + ID.len();
    let rest = &head[at..];
    let colon = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    let rest = rest[colon..].strip_prefix(b":")?;
    let open = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    let rest = rest[open..].strip_prefix(b"\"")?;
    let end = rest.iter().position(|b| *b == b'"' || *b == b'\\')?;
    // An id with an escape, or longer than any server writes, is not one kvroute keys.
    if rest[end] != b'"' || end == 0 || end > 256 {
        return None;
    }
    std::str::from_utf8(&rest[..end]).ok().map(str::to_string)
}

/// The last integer value of the JSON key `key` (quotes included) in `tail`.
fn last_count(tail: &[u8], key: &[u8]) -> Option<u64> {
    let at = tail.windows(key.len()).rposition(|w| w == key)?;
    let rest = &tail[at + key.len()..];
    let rest = trim_ws(rest).strip_prefix(b":")?;
    let rest = trim_ws(rest);
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits == rest.len() {
        // No number, or it may continue past the end of what we kept.
        return None;
    }
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

fn trim_ws(s: &[u8]) -> &[u8] {
    let n = s.iter().take_while(|b| b.is_ascii_whitespace()).count();
    &s[n..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anthropic_usage_counts_only_with_its_cache_fields_and_its_prompt_includes_them() {
        let whole = br#"{"id":"chatcmpl-1","type":"message","content":[],"stop_reason":"end_turn","usage":{"input_tokens":36,"output_tokens":5,"cache_read_input_tokens":2048}}"#;
        let read = usage(whole, true);
        assert_eq!(
            (read.reported, read.cached, read.prompt),
            (true, Some(2048), Some(2084))
        );
        // A stream's: `message_start` has the usage without cache fields, `message_delta` the
        // final one with them.
        let stream = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":2100,\"output_tokens\":0}}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"},\"usage\":{\"input_tokens\":52,\"output_tokens\":8,\"cache_read_input_tokens\":2048,\"cache_creation_input_tokens\":0}}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
        )
        .as_bytes();
        let read = usage(stream, true);
        assert_eq!(
            (read.reported, read.cached, read.prompt),
            (true, Some(2048), Some(2100))
        );
        // No cache fields (no cache details on the server, or nothing cached): unknown, not
        // a miss; read as chat's, `input_tokens` would have said "usage without details".
        let bare = br#"{"type":"message","usage":{"input_tokens":2100,"output_tokens":5}}"#;
        let read = usage(bare, true);
        assert_eq!((read.reported, read.cached, read.prompt), (false, None, Some(2100)));
        // A tool's input before the usage may hold any key.
        let tool = br#"{"content":[{"type":"tool_use","input":{"cache_read_input_tokens":9}}],"usage":{"input_tokens":2100,"output_tokens":5}}"#;
        assert_eq!(usage(tool, true).cached, None);
        assert!(usage(bare, false).reported);
        // Chat's usage reads as before.
        let chat =
            br#"{"usage":{"prompt_tokens":2100,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":2048}}}"#;
        assert_eq!(
            usage(chat, false),
            Usage {
                reported: true,
                cached: Some(2048),
                prompt: Some(2100)
            }
        );
    }

    #[test]
    fn reads_cached_tokens_from_a_non_streaming_body() {
        let body = br#"{"choices":[],"usage":{"prompt_tokens":2100,"prompt_tokens_details":{"cached_tokens":2048},"completion_tokens":5}}"#;
        assert_eq!(cached_tokens(body), Some(2048));
    }

    #[test]
    fn reads_the_last_value_of_a_stream() {
        let body = b"data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\": 16}}}\n\ndata: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\" : 32}}}\n\ndata: [DONE]\n\n";
        assert_eq!(cached_tokens(body), Some(32));
    }

    #[test]
    fn usage_without_details_is_told_apart_from_no_usage() {
        let miss = br#"{"choices":[],"usage":{"prompt_tokens":2100,"completion_tokens":5,"total_tokens":2105}}"#;
        assert!(reports_usage(miss));
        assert_eq!(cached_tokens(miss), None);
        assert!(!reports_usage(
            b"data: {\"choices\":[{\"delta\":{\"content\":\" tok\"}}]}\n\n"
        ));
    }

    #[test]
    fn reads_prompt_and_completion_tokens_apart_from_the_details() {
        let body = br#"{"usage":{"prompt_tokens":2100,"total_tokens":2105,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":2048}}}"#;
        assert_eq!(usage_tokens(body), Some((2100, 5)));
        assert_eq!(prompt_tokens(body), Some(2100));
        assert_eq!(usage_tokens(br#"{"usage":{"prompt_tokens":7}}"#), None);
    }

    #[test]
    fn reads_the_usage_of_a_responses_answer() {
        let body = br#"{"id":"resp_1","output":[],"usage":{"input_tokens":2100,"input_tokens_details":{"cached_tokens":2048},"output_tokens":5,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":2105},"user":null}"#;
        assert!(reports_usage(body));
        assert_eq!(cached_tokens(body), Some(2048));
        assert_eq!(usage_tokens(body), Some((2100, 5)));
        // Text that quotes a key is escaped in JSON, so it never reads as one.
        let quoted = br#"{"text":"say \"input_tokens\": 9","usage":null}"#;
        assert!(!reports_usage(quoted));
    }

    const USAGE_END: &[u8] =
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n";
    const PLAIN_END: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"ok\"}}]}\n\ndata: [DONE]\n\n";

    #[test]
    fn a_server_that_sends_usage_unasked_has_its_streams_read() {
        let mut f = ForcedUsage::default();
        assert!(f.read("a") && f.read("b"), "unknown servers are tried");
        assert!(f.learn("a", USAGE_END));
        assert!(f.learn("b", PLAIN_END));
        assert!(f.sends("a") && !f.sends("b"));
        assert!((0..10).all(|_| f.read("a")));
        let read_b = (0..ForcedUsage::RETRY_EVERY).filter(|_| f.read("b")).count();
        assert_eq!(read_b, 1, "one try in RETRY_EVERY");
        // Restarted with the flag: found at that try.
        assert!(f.learn("b", USAGE_END));
        assert!(f.sends("b"));
        assert!(!f.learn("b", USAGE_END), "no change");
    }

    #[test]
    fn a_stream_cut_short_or_ended_by_an_error_teaches_nothing() {
        let mut f = ForcedUsage::default();
        assert!(f.learn("a", USAGE_END));
        let failed = b"data: {\"error\":{\"message\":\"boom\",\"type\":\"InternalServerError\",\"code\":500}}\n\ndata: [DONE]\n\n";
        assert!(!f.learn("a", failed));
        assert!(f.sends("a"), "one failed stream does not stop the reading");
        assert!(!f.learn("a", b"data: {\"choices\":[{\"delta\":{\"content\":\"ok\"}}]}\n\n"));
        assert!(!f.learn("b", b""));
        assert!(!f.sends("b"));
        assert!(f.read("b"), "still unknown: tried again");
    }

    #[test]
    fn a_responses_streams_first_token_is_its_first_output_event() {
        let created = br#"event: response.created
data: {"response":{"id":"resp_1","instructions":"emit \"type\":\"response.output_text.delta\" events","output":[]},"sequence_number":0,"type":"response.created"}

event: response.in_progress
data: {"response":{"id":"resp_1"},"sequence_number":1,"type":"response.in_progress"}

"#;
        assert!(!holds_output_event(created), "echoed text is escaped");
        let first = br#"event: response.output_item.added
data: {"item":{"id":"msg_1","content":[],"role":"assistant","status":"in_progress","type":"message"},"output_index":0,"sequence_number":2,"type":"response.output_item.added"}

"#;
        assert!(holds_output_event(first));
    }

    #[test]
    fn reads_a_responses_id_from_the_first_bytes() {
        let whole = br#"{"id":"resp_0123abcd","created_at":1}"#;
        assert_eq!(response_id(whole).as_deref(), Some("resp_0123abcd"));
        let stream = b"event: response.created\ndata: {\"response\":{\"id\": \"resp_9\",\"created_at\":1},\"sequence_number\":0,\"type\":\"response.created\"}\n\n";
        assert_eq!(response_id(stream).as_deref(), Some("resp_9"));
        let typed_first =
            br#"data: {"type":"response.created","sequence_number":0,"item_id":"msg_1","response":{"id":"resp_7"}}"#;
        assert_eq!(response_id(typed_first).as_deref(), Some("resp_7"), "item_id is not id");
        assert_eq!(response_id(br#"{"id":"resp_01"#), None, "cut: the id may continue");
        assert_eq!(response_id(br#"{"id":"a\"b"}"#), None);
        assert_eq!(response_id(br#"{"id":null}"#), None);
        assert_eq!(response_id(br#"{"id":""}"#), None);
    }

    #[test]
    fn missing_null_or_cut_values_give_none() {
        assert_eq!(cached_tokens(b"{\"usage\":{}}"), None);
        assert_eq!(cached_tokens(b"{\"cached_tokens\":null}"), None);
        assert_eq!(cached_tokens(b"{\"cached_tokens\":12"), None, "the number may continue");
        assert_eq!(cached_tokens(b""), None);
    }
}
