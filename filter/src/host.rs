//! Host calls wrapped in functions that return `Result`, so no SDK convenience can unwrap
//! on our behalf. Every caller treats an error as "fail open": let Envoy balance.

use std::time::{Duration, UNIX_EPOCH};

use kvroute_core::Millis;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType, Status};

pub type HostResult<T> = Result<T, Status>;

/// Host time in milliseconds (the one clock the filter reads): Envoy's wall clock, made
/// monotonic across the process (`clock`).
pub fn now() -> Millis {
    crate::clock::now()
}

/// Envoy's wall clock in ms since the epoch, when it answers.
pub fn wall_ms() -> Option<u64> {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
}

pub fn log(level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, message);
}

/// Every request header in one host call (cheaper than one call per header). Values are
/// bytes: Envoy passes obs-text (bytes above 0x7f) through, and the SDK's string getters
/// would panic on it. Names are lower-case tokens.
pub fn request_headers() -> HostResult<Vec<(String, Vec<u8>)>> {
    hostcalls::get_map_bytes(MapType::HttpRequestHeaders)
}

pub fn set_request_header(name: &str, value: Option<&str>) -> HostResult<()> {
    hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value)
}

pub fn response_header(name: &str) -> HostResult<Option<Vec<u8>>> {
    hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name)
}

pub fn add_response_header(name: &str, value: &str) -> HostResult<()> {
    hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value)
}

fn call_response_header(name: &str) -> HostResult<Option<Vec<u8>>> {
    hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, name)
}

/// The `:status` of an HTTP call's answer with `num_headers` headers. A call that failed
/// (the upstream reset it after its headers, e.g. a server killed in the middle of an
/// answer) comes with none: Envoy then has no response map, and reading one is an error the
/// SDK turns into a panic, so nothing is read.
pub fn call_status(num_headers: usize) -> Option<Vec<u8>> {
    call_header(num_headers, ":status")
}

/// The header `name` of an HTTP call's answer with `num_headers` headers; none is read from
/// a call that failed (`call_status`).
pub fn call_header(num_headers: usize, name: &str) -> Option<Vec<u8>> {
    (num_headers > 0)
        .then(|| call_response_header(name).ok().flatten())
        .flatten()
}

pub fn buffer(kind: BufferType, start: usize, len: usize) -> HostResult<Vec<u8>> {
    hostcalls::get_buffer(kind, start, len).map(Option::unwrap_or_default)
}

pub fn property(path: &[&str]) -> HostResult<Option<Vec<u8>>> {
    hostcalls::get_property(path.to_vec())
}

pub fn property_string(path: &[&str]) -> Option<String> {
    property(path).ok().flatten().and_then(|b| String::from_utf8(b).ok())
}

/// Sets the stream's filter state `wasm.<name>` (bytes), readable by access logs.
pub fn set_property(name: &str, value: &[u8]) -> HostResult<()> {
    hostcalls::set_property(vec![name], Some(value))
}

pub fn send_local_response(status: u32, headers: Vec<(&str, &str)>, body: &[u8]) -> HostResult<()> {
    hostcalls::send_http_response(status, headers, Some(body))
}

pub fn dispatch_get(cluster: &str, authority: &str, path: &str, route_to: &str, timeout_ms: u64) -> HostResult<u32> {
    let headers = vec![
        (":method", "GET"),
        (":path", path),
        (":authority", authority),
        (":scheme", "http"),
        (crate::DESTINATION_HEADER, route_to),
    ];
    hostcalls::dispatch_http_call(cluster, headers, None, vec![], Duration::from_millis(timeout_ms))
}

/// GETs `path` from Envoy's own admin through `cluster` (a cluster pointing at the admin).
pub fn dispatch_admin_get(cluster: &str, path: &str, timeout_ms: u64) -> HostResult<u32> {
    let headers = vec![
        (":method", "GET"),
        (":path", path),
        (":authority", "envoy-admin"),
        (":scheme", "http"),
    ];
    hostcalls::dispatch_http_call(cluster, headers, None, vec![], Duration::from_millis(timeout_ms))
}

/// POSTs `body` to `route_to` through `cluster` (an `override_host` cluster) with the
/// replicas' shared secret.
pub fn dispatch_post(
    cluster: &str,
    route_to: &str,
    path: &str,
    secret: &str,
    body: &[u8],
    timeout_ms: u64,
) -> HostResult<u32> {
    let headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", route_to),
        (":scheme", "http"),
        ("content-type", "application/x-protobuf"),
        (crate::DESTINATION_HEADER, route_to),
        (crate::PEER_SECRET_HEADER, secret),
    ];
    hostcalls::dispatch_http_call(cluster, headers, Some(body), vec![], Duration::from_millis(timeout_ms))
}

pub fn set_tick_period_ms(ms: u64) -> HostResult<()> {
    hostcalls::set_tick_period(Duration::from_millis(ms))
}

pub fn shared_data(key: &str) -> HostResult<Option<Vec<u8>>> {
    hostcalls::get_shared_data(key).map(|(data, _)| data)
}

pub fn set_shared_data(key: &str, value: &[u8]) -> HostResult<()> {
    hostcalls::set_shared_data(key, Some(value), None)
}

/// A shared value and its compare-and-swap token (`None` for both when the key is absent).
pub fn shared_data_cas(key: &str) -> HostResult<(Option<Vec<u8>>, Option<u32>)> {
    hostcalls::get_shared_data(key)
}

/// Writes `value` only if the key still carries `cas`, the token of the read this write
/// follows (`Err(Status::CasMismatch)` if another VM wrote it since); `None`, the key was
/// absent, creates it only if it still is.
pub fn set_shared_data_cas(key: &str, value: &[u8], cas: Option<u32>) -> HostResult<()> {
    hostcalls::set_shared_data(key, Some(value), Some(cas_token(cas)))
}

/// The token `set_shared_data_cas` sends for `cas`: the read's, or `CREATE_ONLY`.
pub fn cas_token(cas: Option<u32>) -> u32 {
    cas.unwrap_or(CREATE_ONLY)
}

/// The compare-and-swap token that creates a key only if it is absent (shared data has no
/// create call). Envoy checks a token only against a present key, and refuses a write whose
/// token is not the key's; tokens count up from 1 over every write to shared data, wrapping
/// past 0, so a present key carries this one only in the write of every 4,294,967,295 that
/// reaches it.
pub const CREATE_ONLY: u32 = u32::MAX;

/// Host time in nanoseconds (a per-VM nonce source; no other use).
pub fn now_nanos() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64)
}

pub fn define_metric(kind: MetricType, name: &str) -> HostResult<u32> {
    hostcalls::define_metric(kind, name)
}

pub fn increment_metric(id: u32, by: i64) -> HostResult<()> {
    hostcalls::increment_metric(id, by)
}

pub fn record_metric(id: u32, value: u64) -> HostResult<()> {
    hostcalls::record_metric(id, value)
}

/// Makes the following host calls act on stream `context_id` (a held request, from the
/// worker's tick).
pub fn set_effective_context(context_id: u32) -> HostResult<()> {
    hostcalls::set_effective_context(context_id)
}

/// Resumes the effective stream's paused request.
pub fn resume_http_request() -> HostResult<()> {
    hostcalls::resume_http_request()
}
