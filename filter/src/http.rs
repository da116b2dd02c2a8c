//! The HTTP context: strips client-sent routing headers, buffers inference bodies, asks the
//! router, sets `x-gateway-destination-endpoint`, and reports how the request ended.
//!
//! Every failure of its own (a host call, a body it cannot parse, a busy router) ends in
//! `Continue` without a destination header, so Envoy's fallback policy balances the request.
//! The header is only ever set while the request headers are still paused.

use std::rc::Rc;

use kvroute_core::request::{parse, response_key, stored_response_path, ApiKind};
use kvroute_core::response::usage;
use kvroute_core::{Completion, Outcome};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, LogLevel};

use crate::hold::Slot;
use crate::host;
use crate::replicas::count_direct_answer;
use crate::worker::Shared;
use crate::DESTINATION_HEADER;

mod capture;
mod held;
mod peer_batch;
mod trailers;
use capture::Captured;

/// Bytes of the response kept to find `usage.prompt_tokens_details.cached_tokens`.
const TAIL_BYTES: usize = 4096;
/// Bytes at the start of a Responses answer searched for its id (vLLM writes it first: the
/// whole response's first field, a stream's first event's response's first field).
const HEAD_BYTES: usize = 2048;

#[derive(Debug, PartialEq)]
enum Phase {
    PassThrough,
    Buffering(ApiKind),
    Routed {
        request_id: u64,
        /// The prompt's tokens and those predicted cached (`Routed`).
        tokens: (u64, u64),
    },
    /// Another gateway replica forwarding its placements (`share.replicas.path`).
    PeerBatch,
}

pub struct Http {
    shared: Option<Rc<Shared>>,
    context_id: u32,
    phase: Phase,
    tenant: String,
    /// From the priority header (0 without one); negative: sheddable.
    priority: i64,
    /// Held while every server was full: what the tick did with it (see `hold`).
    release: Option<Slot>,
    /// From `tiers.objective_header`, when positive.
    ttft_objective_ms: Option<f64>,
    chosen: Option<String>,
    reason: &'static str,
    status: u16,
    /// Response headers came (the server's or Envoy's own): without them at the end, the
    /// client left before any response.
    responded: bool,
    /// Keep the response tail: the response will carry `usage` (see `reports_usage`).
    read_usage: bool,
    /// An Anthropic `/v1/messages` answer: its usage is read as Anthropic writes it.
    anthropic: bool,
    /// A stream that did not ask for `usage` (`ParsedRequest::usage_unasked`), and whether
    /// it is read to learn whether its server sends it anyway (`ForcedUsage`).
    usage_unasked: bool,
    learn_usage: bool,
    /// A streamed request whose first response bytes have not come yet (its first token:
    /// the headers of a stream may come before it).
    awaiting_first_chunk: bool,
    /// A stream whose first bytes are not its first token (Responses: see
    /// `response::holds_output_event`).
    first_token_later: bool,
    /// A Responses request the server may store: the start of its answer, until its id is
    /// read (`None` once read, or when there is nothing to learn).
    head: Option<Vec<u8>>,
    tail: Vec<u8>,
    /// What the capture line needs from the request, when this one is in the sample.
    capture: Option<Box<Captured>>,
}

impl Http {
    pub fn new(shared: Option<Rc<Shared>>, context_id: u32) -> Http {
        Http {
            shared,
            context_id,
            phase: Phase::PassThrough,
            tenant: String::new(),
            priority: 0,
            release: None,
            ttft_objective_ms: None,
            chosen: None,
            reason: "passthrough",
            status: 0,
            responded: false,
            read_usage: false,
            anthropic: false,
            usage_unasked: false,
            learn_usage: false,
            awaiting_first_chunk: false,
            first_token_later: false,
            head: None,
            tail: Vec::new(),
            capture: None,
        }
    }

    /// A client must never choose the upstream: remove the header on every request. The
    /// removal is unconditional because a request-header change also makes Envoy pick the
    /// route again, which matters when Envoy's own header_mutation filter already stripped
    /// the header after the route was first chosen on it (envoy-original-dst.yaml routes on
    /// its presence).
    fn strip_client_routing(&self, headers: &Headers) -> Result<(), ()> {
        if let (Some(s), Some(_)) = (&self.shared, headers.get(DESTINATION_HEADER)) {
            s.stats.client_header_removed.inc();
        }
        host::set_request_header(DESTINATION_HEADER, None).map_err(|_| ())
    }

    /// The whole body is buffered (`body_size` bytes): decides, or leaves the request to
    /// Envoy's balancing past `max_body_bytes`.
    fn on_body_end(&mut self, shared: &Shared, body_size: usize) -> Action {
        let Phase::Buffering(kind) = self.phase else {
            return Action::Continue;
        };
        self.phase = Phase::PassThrough;
        if body_size > shared.router.try_borrow().map_or(0, |r| r.config().max_body_bytes()) {
            shared.stats.skipped_over_limit.inc();
            self.reason = "over_limit";
            return Action::Continue;
        }
        match host::buffer(BufferType::HttpRequestBody, 0, body_size) {
            Ok(body) => self.decide(shared, kind, &body),
            Err(_) => {
                shared.stats.skipped_error.inc();
                Action::Continue
            }
        }
    }

    fn decide(&mut self, shared: &Shared, kind: ApiKind, body: &[u8]) -> Action {
        let parsed = match parse(kind, body) {
            Ok(p) => p,
            Err(e) => {
                host::log(LogLevel::Debug, &format!("not routing: {e}"));
                shared.stats.skipped_malformed.inc();
                self.reason = "malformed";
                return Action::Continue;
            }
        };
        let Ok(mut router) = shared.router.try_borrow_mut() else {
            shared.stats.skipped_error.inc();
            return Action::Continue;
        };
        let now = host::now();
        shared.catch_up(&mut router, now);
        shared.peers.before_route(&mut router, &shared.stats, now);
        let mut req = router.request(&parsed, &self.tenant, self.priority < 0);
        req.ttft_objective_ms = self.ttft_objective_ms;
        // Every request that reaches a decision is traffic to capture, whatever the decision
        // (shed, left to Envoy, routed): a replay sizes the fleet for all of it.
        self.sample_capture(shared, &req, now);
        // A stream without `include_usage` never reports cached tokens: copying its chunks
        // into the VM (one host call each) would buy nothing.
        self.read_usage = parsed.reports_usage;
        self.anthropic = kind == ApiKind::Messages;
        self.usage_unasked = parsed.usage_unasked;
        self.awaiting_first_chunk = parsed.stream;
        let mut home_known = false;
        let mut await_home = None;
        if kind == ApiKind::Responses {
            self.first_token_later = true;
            if !parsed.stores {
                self.head = None;
            }
            if let Some(response) = req.continues.filter(|_| router.config().stored_responses()) {
                home_known = shared.find_home(&mut router, response, now).is_some();
                if !home_known && router.config().share().replicas.is_some() {
                    // Another replica may be sending it this very moment (`homes`).
                    await_home = Some(response);
                } else if !home_known {
                    shared.stats.home_unknown.inc();
                }
            }
        }
        if let Some(response) = await_home {
            if let Some(slot) = shared.await_home(self.context_id, Some(req.clone()), response, now) {
                self.release = Some(slot);
                // What it is if the wait ends without a home (sent home, the tick says so).
                self.reason = "response_home_unknown";
                return Action::Pause;
            }
            shared.stats.home_unknown.inc();
        }
        // Behind requests already held here that may use its servers, a new one waits its
        // turn; a continuation whose home is known goes there at once (no other server can
        // answer it).
        let decision = if !home_known && shared.holding(|| router.serving_mask(&req)) {
            None
        } else {
            Some(router.route(&req, now))
        };
        if let Some(t) = decision.as_ref().and_then(|d| d.tier) {
            shared.stats.tier_spilled.add(u64::from(t.spilled));
            shared.stats.tier_unmet.add(u64::from(!t.met));
        }
        let outcome = decision.as_ref().map_or(Outcome::Hold, |d| d.outcome);
        self.reason = outcome.label();
        match outcome {
            Outcome::Shed { retry_after_s } => {
                shared.stats.shed.inc();
                if crate::hold::answer_429(retry_after_s) {
                    self.status = 429;
                    return Action::Pause;
                }
                return Action::Continue;
            }
            Outcome::Hold => {
                let servers = router.serving_mask(&req);
                let overload = router.config().overload();
                let bound_ms = overload.hold.wait_bound_ms(req.ttft_objective_ms);
                return self.hold(shared, req, servers, bound_ms, now, overload.retry_after_s);
            }
            Outcome::Fallback(_) => {
                shared.count_outcome(&outcome);
                return Action::Continue;
            }
            Outcome::PrefixHit | Outcome::Cold | Outcome::ResponseHome => {}
        }
        let Some(decision) = decision else {
            return Action::Continue;
        };
        let Some(routed) = shared.apply_decision(&mut router, &req, &decision, now) else {
            self.reason = "host_error";
            return Action::Continue;
        };
        self.chosen = Some(routed.best);
        self.read_forced_usage(shared);
        self.phase = Phase::Routed {
            request_id: routed.request_id,
            tokens: (routed.prompt_tokens, routed.predicted_cached),
        };
        Action::Continue
    }
}

impl Http {
    /// The destination header could not be checked or removed: refuse rather than risk a
    /// client choosing the upstream.
    fn refuse_unsanitised(&self) -> Action {
        host::log(
            LogLevel::Error,
            "cannot check or remove a client-sent destination header; refusing the request",
        );
        let _ = host::send_local_response(500, vec![], b"cannot sanitise routing headers\n");
        Action::Pause
    }
}

/// The request headers, read once.
struct Headers(Vec<(String, Vec<u8>)>);

impl Headers {
    fn get(&self, name: &str) -> Option<&[u8]> {
        self.0
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// A header's value when it is UTF-8 (names and values kvroute parses are ASCII).
    fn text(&self, name: &str) -> Option<&str> {
        self.get(name).and_then(|v| std::str::from_utf8(v).ok())
    }
}

/// The tenant's affinity key: the header value itself when it is UTF-8; otherwise a NUL
/// (which no header value can hold) and the bytes in hex, so distinct byte strings never
/// share a key.
fn tenant_key(value: &[u8]) -> String {
    match std::str::from_utf8(value) {
        Ok(s) => s.to_string(),
        Err(_) => std::iter::once("\0".to_string())
            .chain(value.iter().map(|b| format!("{b:02x}")))
            .collect(),
    }
}

impl Http {
    /// Whether `served_by`, the upstream that answered, is not the server kvroute chose: a
    /// retry moved the request.
    fn moved_from_choice(&self, served_by: Option<&str>) -> bool {
        matches!((served_by, &self.chosen), (Some(s), Some(c)) if s != c)
    }

    /// The routed request's prefill is done (see `Router::on_first_token`); when a retry
    /// moved it to another server, its time is not learned from.
    fn first_token(&self) {
        if let (Phase::Routed { request_id, .. }, Some(shared)) = (&self.phase, &self.shared) {
            if let Ok(mut router) = shared.router.try_borrow_mut() {
                // Only tiers learn from first tokens: without them, no host call here.
                let moved = router.config().tiers().on()
                    && self.moved_from_choice(host::property_string(&["upstream", "address"]).as_deref());
                if moved {
                    router.on_first_token_elsewhere(*request_id, host::now());
                } else {
                    router.on_first_token(*request_id, host::now());
                }
            }
        }
    }
}

impl Http {
    /// A request about a stored response (`GET /v1/responses/{id}`, its cancel): sent to
    /// the server that stored it, when known, or once another replica sends it (`homes`);
    /// otherwise Envoy balances it (and a server that does not hold it answers 404).
    fn send_home(&mut self, shared: &Shared, id: &str, end_of_stream: bool) -> Action {
        let response = response_key(id);
        let now = host::now();
        let found = shared.router.try_borrow_mut().ok().map(|mut r| {
            let home = shared.find_home(&mut r, response, now).map(|h| h.to_string());
            (home, r.config().share().replicas.is_some())
        });
        let Some((home, replicas)) = found else {
            shared.stats.skipped_error.inc();
            return Action::Continue;
        };
        let Some(home) = home else {
            self.reason = "response_home_unknown";
            if replicas && end_of_stream {
                if let Some(slot) = shared.await_home(self.context_id, None, response, now) {
                    self.release = Some(slot);
                    return Action::Pause;
                }
            }
            // Envoy balances it, as any request that is not inference.
            shared.stats.home_unknown.inc();
            shared.stats.passthrough.inc();
            return Action::Continue;
        };
        if host::set_request_header(crate::DESTINATION_HEADER, Some(&home)).is_ok() {
            shared.stats.response_home.inc();
            self.reason = Outcome::ResponseHome.label();
            self.chosen = Some(home);
        } else {
            shared.stats.passthrough.inc();
        }
        Action::Continue
    }

    /// A server started with --enable-force-include-usage sends usage to streams that did not
    /// ask: read there, and tried on each server to find out. Once the request has its server.
    pub(super) fn read_forced_usage(&mut self, shared: &Shared) {
        let Some(chosen) = self.chosen.as_deref().filter(|_| self.usage_unasked) else {
            return;
        };
        if shared.forced_usage.try_borrow_mut().is_ok_and(|mut f| f.read(chosen)) {
            self.read_usage = true;
            self.learn_usage = true;
        }
    }

    /// What a stream read by `ForcedUsage` showed of its server's habit.
    fn learn_forced_usage(&self, shared: &Shared, served_by: Option<&kvroute_core::EndpointId>) {
        let (Some(server), Ok(mut forced)) = (served_by, shared.forced_usage.try_borrow_mut()) else {
            return;
        };
        if forced.learn(server.as_str(), &self.tail) {
            let habit = if forced.sends(server.as_str()) {
                "sends"
            } else {
                "does not send"
            };
            host::log(
                LogLevel::Info,
                &format!("server {server} {habit} usage in streams that do not ask for it"),
            );
        }
    }

    /// Reads the id of a Responses answer from its first bytes (this chunk, `whole` when
    /// already read) and tells the router where it is stored: the upstream that answered
    /// (Envoy's choice too, when kvroute chose none). Only a successful answer is stored.
    fn learn_home(&mut self, body_size: usize, whole: Option<&[u8]>) {
        let Some(head) = self.head.as_mut() else { return };
        if self.status != 200 {
            self.head = None;
            return;
        }
        let want = HEAD_BYTES.saturating_sub(head.len()).min(body_size);
        match whole {
            Some(w) => head.extend_from_slice(&w[..want.min(w.len())]),
            None => {
                if let Ok(chunk) = host::buffer(BufferType::HttpResponseBody, 0, want) {
                    head.extend_from_slice(&chunk);
                }
            }
        }
        let id = kvroute_core::response::response_id(head);
        if id.is_none() && head.len() < HEAD_BYTES && want == body_size {
            return;
        }
        self.head = None;
        let (Some(id), Some(shared)) = (id, &self.shared) else {
            return;
        };
        let Some(served_by) = host::property_string(&["upstream", "address"]) else {
            return;
        };
        if let Ok(mut router) = shared.router.try_borrow_mut() {
            router.on_stored(&id, &kvroute_core::EndpointId::new(served_by));
            shared.stats.homes_learned.inc();
            // Before the client has the id: a follow-up through any worker finds its home.
            shared.peers.publish_now(&mut router, &shared.stats, host::now());
        }
    }
}

impl Context for Http {
    /// The answer to this worker's own POST of a placement to another replica, sent from
    /// this request's context (`replicas::DirectSender`): the only call a stream makes.
    fn on_http_call_response(&mut self, _token: u32, num_headers: usize, _body_size: usize, _num_trailers: usize) {
        if let Some(shared) = &self.shared {
            count_direct_answer(num_headers, &shared.stats);
        }
    }

    fn on_done(&mut self) -> bool {
        self.adopt_release();
        true
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let headers = match host::request_headers() {
            Ok(h) => Headers(h),
            Err(_) => return self.refuse_unsanitised(),
        };
        #[cfg(feature = "test-panic")]
        #[allow(clippy::panic)]
        if let Some(which) = headers.text("x-kvroute-test-panic") {
            // `lease`: the VM holding the polling lease panics at its next tick.
            if which == "lease" {
                let _ = host::set_shared_data(crate::lease::TEST_PANIC_KEY, b"1");
            } else {
                panic!("x-kvroute-test-panic");
            }
        }
        if self.strip_client_routing(&headers).is_err() {
            return self.refuse_unsanitised();
        }
        let Some(shared) = self.shared.clone() else {
            return Action::Continue;
        };
        if let Some(action) = self.peer_batch_headers(&shared, &headers, end_of_stream) {
            return action;
        }
        if let Some(id) = headers.text(":path").and_then(stored_response_path) {
            if shared.router.try_borrow().is_ok_and(|r| r.config().stored_responses()) {
                return self.send_home(&shared, id, end_of_stream);
            }
            shared.stats.passthrough.inc();
            return Action::Continue;
        }
        let kind = headers.text(":path").and_then(ApiKind::from_path);
        let (Some("POST"), Some(kind)) = (headers.text(":method"), kind) else {
            shared.stats.passthrough.inc();
            return Action::Continue;
        };
        if end_of_stream {
            shared.stats.skipped_malformed.inc();
            return Action::Continue;
        }
        let Ok(router) = shared.router.try_borrow() else {
            shared.stats.skipped_error.inc();
            return Action::Continue;
        };
        let config = router.config();
        // Learned whether or not kvroute routes it (a body over the limit, malformed):
        // its follow-ups need its home all the same. `decide` stops it for `store: false`.
        if kind == ApiKind::Responses && config.stored_responses() {
            self.head = Some(Vec::new());
        }
        let length = headers.text("content-length").and_then(|v| v.parse::<usize>().ok());
        if length.is_some_and(|n| n > config.max_body_bytes()) {
            shared.stats.skipped_over_limit.inc();
            self.reason = "over_limit";
            return Action::Continue;
        }
        self.tenant = headers.get(config.tenant_header()).map(tenant_key).unwrap_or_default();
        self.priority = headers
            .text(config.priority_header())
            .and_then(|v| v.trim().parse::<i64>().ok())
            .unwrap_or(0);
        self.ttft_objective_ms = headers
            .text(&config.tiers().objective_header)
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|ms| ms.is_finite() && *ms > 0.0);
        self.phase = Phase::Buffering(kind);
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.phase == Phase::PeerBatch {
            return self.peer_batch_body(body_size, end_of_stream);
        }
        if !matches!(self.phase, Phase::Buffering(_)) {
            return Action::Continue;
        }
        let Some(shared) = self.shared.clone() else {
            return Action::Continue;
        };
        if !end_of_stream && body_size <= shared.router.try_borrow().map_or(0, |r| r.config().max_body_bytes()) {
            return Action::Pause;
        }
        self.on_body_end(&shared, body_size)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.request_trailers()
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.adopt_release();
        self.responded = true;
        self.status = host::response_header(":status")
            .ok()
            .flatten()
            .and_then(|s| std::str::from_utf8(&s).ok().and_then(|s| s.parse().ok()))
            .unwrap_or(0);
        // A whole response's headers come when generation ends: its prefill is long done.
        // A stream's may come before its first token (the server starts the response
        // first): that one waits for the first chunk. An error (vLLM's 503, a 400) had no
        // prefill: its quick answer is no first token (it would read as a fast prefill and
        // as a prompt the server counted).
        if !(200..300).contains(&self.status) {
            self.awaiting_first_chunk = false;
        } else if !self.awaiting_first_chunk {
            self.first_token();
        }
        let debug = self
            .shared
            .as_ref()
            .and_then(|s| s.router.try_borrow().ok().map(|r| r.config().debug_headers()));
        if debug == Some(true) {
            if let Some(chosen) = &self.chosen {
                let _ = host::add_response_header("x-kvroute-endpoint", chosen);
            }
            let _ = host::add_response_header("x-kvroute-reason", self.reason);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // A Responses stream's chunks before its first token (a few small events) are read
        // whole, once: for the first output event, the id and the tail alike.
        let whole = (self.awaiting_first_chunk && self.first_token_later && body_size > 0)
            .then(|| host::buffer(BufferType::HttpResponseBody, 0, body_size).ok())
            .flatten();
        if self.head.is_some() && body_size > 0 {
            self.learn_home(body_size, whole.as_deref());
        }
        let first_token = !self.first_token_later
            || end_of_stream
            || whole.as_deref().is_some_and(kvroute_core::response::holds_output_event);
        if self.awaiting_first_chunk && (body_size > 0 || end_of_stream) && first_token {
            self.awaiting_first_chunk = false;
            self.first_token();
        }
        let wanted = matches!(self.phase, Phase::Routed { .. }) || self.capture.is_some();
        if self.read_usage && wanted && body_size > 0 {
            let start = body_size.saturating_sub(TAIL_BYTES);
            let chunk = match &whole {
                Some(w) => Ok(w[start.min(w.len())..].to_vec()),
                None => host::buffer(BufferType::HttpResponseBody, start, body_size - start),
            };
            if let Ok(chunk) = chunk {
                self.tail.extend_from_slice(&chunk);
                let excess = self.tail.len().saturating_sub(TAIL_BYTES);
                self.tail.drain(..excess);
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.adopt_release();
        let Some(shared) = self.shared.clone() else { return };
        let (routed, tokens) = match self.phase {
            Phase::Routed { request_id, tokens } => (Some(request_id), tokens),
            _ => (None, (0, 0)),
        };
        if routed.is_none() && self.capture.is_none() {
            return;
        }
        let served_by = host::property_string(&["upstream", "address"]).map(kvroute_core::EndpointId::new);
        let usage = usage(&self.tail, self.anthropic);
        let cached = usage.cached;
        let prompt = if self.anthropic { usage.prompt } else { None };
        self.write_capture(&shared, served_by.as_ref().map(|e| e.as_str()), cached, prompt);
        let Some(request_id) = routed else { return };
        let moved = self.moved_from_choice(served_by.as_ref().map(|e| e.as_str()));
        if moved {
            shared.stats.refused_moved.inc();
        }
        // Envoy's own 5xx (a connect failure after the last retry, no healthy host) is no
        // server's answer: it counts as no response at all, so passive health still sees it,
        // and a 503 means the server's own refusal. Read only for a 5xx (one host call).
        let local = self.status >= 500
            && host::property_string(&["response", "code_details"]).is_some_and(|d| d != "via_upstream");
        let status = if local { 0 } else { self.status };
        if status == 503 {
            shared.stats.refused_by_server.inc();
        }
        if let Some(c) = cached {
            shared.stats.reported_cached_tokens.add(c);
        }
        // The requests whose answer carried usage, where vLLM reports its cached tokens (it
        // leaves the details out when nothing was cached): the reported share's own
        // denominator, so that streams which did not ask for usage do not read as misses.
        if usage.reported {
            shared.stats.prompt_tokens_reported.add(tokens.0);
            shared.stats.predicted_cached_tokens_reported.add(tokens.1);
        }
        if !self.responded {
            shared.stats.client_left.inc();
        }
        if self.learn_usage && status == 200 {
            self.learn_forced_usage(&shared, served_by.as_ref());
        }
        if usage.reported {
            shared.stats.usage_reported.inc();
        } else {
            shared.stats.usage_missing.inc();
        }
        let Ok(mut router) = shared.router.try_borrow_mut() else {
            // Never expected (callbacks do not nest while the router is held); counted, as
            // the request's load then stays in this worker's view.
            shared.stats.skipped_error.inc();
            return;
        };
        let done = Completion {
            served_by,
            status,
            cached_tokens: cached,
            prompt_tokens: usage.prompt,
            usage: usage.reported,
            client_left: !self.responded,
        };
        if let Some(flip) = router.on_completed(request_id, &done, host::now()) {
            host::log(LogLevel::Warn, &format!("passive health: {flip:?}"));
        }
    }
}
