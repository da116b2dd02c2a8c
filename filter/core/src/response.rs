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
const USAGE: &[u8] = b"\"prompt_tokens\"";
const COMPLETION: &[u8] = b"\"completion_tokens\"";

/// Whether `tail` holds a `usage` object (its `prompt_tokens`).
pub fn reports_usage(tail: &[u8]) -> bool {
    tail.windows(USAGE.len()).any(|w| w == USAGE)
}

/// The last `cached_tokens` value in `tail`, if one is there whole.
pub fn cached_tokens(tail: &[u8]) -> Option<u64> {
    last_count(tail, CACHED)
}

/// The last `usage.prompt_tokens` in `tail`.
pub fn prompt_tokens(tail: &[u8]) -> Option<u64> {
    last_count(tail, USAGE)
}

/// The last `usage.prompt_tokens` and `usage.completion_tokens` in `tail`, when both are there.
pub fn usage_tokens(tail: &[u8]) -> Option<(u64, u64)> {
    Some((last_count(tail, USAGE)?, last_count(tail, COMPLETION)?))
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
    fn missing_null_or_cut_values_give_none() {
        assert_eq!(cached_tokens(b"{\"usage\":{}}"), None);
        assert_eq!(cached_tokens(b"{\"cached_tokens\":null}"), None);
        assert_eq!(cached_tokens(b"{\"cached_tokens\":12"), None, "the number may continue");
        assert_eq!(cached_tokens(b""), None);
    }
}
