//! Host calls wrapped in functions that return `Result`, so no SDK convenience can unwrap
//! on our behalf. Every caller treats an error as "fail open": let Envoy balance.
//!
//! The SDK's own wrappers (proxy-wasm 0.2) panic on most statuses they do not expect, which
//! traps the VM: Envoy then fails the worker's streams open, but cuts the ones in flight.
//! The calls a request's path makes on a stream that may have changed under it (setting or
//! removing the destination header, resuming a paused request, a local reply, a filter
//! state, the tick period) go to the host's functions directly (`raw`), so any status other
//! than success comes back as an error for the caller's fallback.

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
    let map = MapType::HttpRequestHeaders as u32;
    // SAFETY: the pointers and lengths are those of live `&str`s, which the host only reads
    // during the call.
    let code = unsafe {
        match value {
            Some(v) => raw::proxy_replace_header_map_value(map, name.as_ptr(), name.len(), v.as_ptr(), v.len()),
            None => raw::proxy_remove_header_map_value(map, name.as_ptr(), name.len()),
        }
    };
    raw::result(code)
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
    // A path of one part is the part's bytes (the SDK's encoding joins parts with NUL).
    // SAFETY: live slices, read by the host during the call.
    raw::result(unsafe { raw::proxy_set_property(name.as_ptr(), name.len(), value.as_ptr(), value.len()) })
}

pub fn send_local_response(status: u32, headers: Vec<(&str, &str)>, body: &[u8]) -> HostResult<()> {
    let headers = raw::pairs(&headers);
    // SAFETY: live buffers, read by the host during the call; no details string (null, 0),
    // no gRPC status (-1), as the SDK sends them.
    let code = unsafe {
        raw::proxy_send_local_response(
            status,
            std::ptr::null(),
            0,
            body.as_ptr(),
            body.len(),
            headers.as_ptr(),
            headers.len(),
            -1,
        )
    };
    raw::result(code)
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
    let ms = u32::try_from(ms).unwrap_or(u32::MAX);
    // SAFETY: no memory is shared.
    raw::result(unsafe { raw::proxy_set_tick_period_milliseconds(ms) })
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
    // SAFETY: no memory is shared. Stream type 0 is the HTTP request.
    raw::result(unsafe { raw::proxy_continue_stream(0) })
}

/// The host's functions behind the SDK's panicking wrappers (the proxy-wasm ABI 0.2.1, as
/// the SDK declares them), with statuses as plain numbers: a status this build does not
/// know is an error, not an invalid enum value.
mod raw {
    use proxy_wasm::types::Status;

    extern "C" {
        pub fn proxy_replace_header_map_value(
            map_type: u32,
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
        ) -> u32;
        pub fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
        pub fn proxy_continue_stream(stream_type: u32) -> u32;
        #[allow(clippy::too_many_arguments)]
        pub fn proxy_send_local_response(
            status_code: u32,
            status_code_details_data: *const u8,
            status_code_details_size: usize,
            body_data: *const u8,
            body_size: usize,
            headers_data: *const u8,
            headers_size: usize,
            grpc_status: i32,
        ) -> u32;
        pub fn proxy_set_property(
            path_data: *const u8,
            path_size: usize,
            value_data: *const u8,
            value_size: usize,
        ) -> u32;
        pub fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    }

    /// A host status as a result.
    pub fn result(code: u32) -> Result<(), Status> {
        match code {
            0 => Ok(()),
            1 => Err(Status::NotFound),
            2 => Err(Status::BadArgument),
            3 => Err(Status::SerializationFailure),
            4 => Err(Status::ParseFailure),
            7 => Err(Status::Empty),
            8 => Err(Status::CasMismatch),
            _ => Err(Status::InternalFailure),
        }
    }

    /// Header pairs in the ABI's encoding: their count, each name's and value's length, then
    /// each name and value followed by a NUL (all numbers u32, little-endian).
    pub fn pairs(map: &[(&str, &str)]) -> Vec<u8> {
        let size = 4 + map.iter().map(|(n, v)| n.len() + v.len() + 10).sum::<usize>();
        let mut out = Vec::with_capacity(size);
        out.extend((map.len() as u32).to_le_bytes());
        for (name, value) in map {
            out.extend((name.len() as u32).to_le_bytes());
            out.extend((value.len() as u32).to_le_bytes());
        }
        for (name, value) in map {
            out.extend_from_slice(name.as_bytes());
            out.push(0);
            out.extend_from_slice(value.as_bytes());
            out.push(0);
        }
        out
    }
}
