//! The smallest Rust proxy-wasm HTTP filter: every callback continues at once. It exists
//! only as the floor of the overhead benchmark (`make bench-overhead`): what any Rust wasm
//! filter costs in Envoy before it does anything, measured beside kvroute in one run.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(EmptyRoot) });
}}

struct EmptyRoot;

impl Context for EmptyRoot {}

impl RootContext for EmptyRoot {
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(EmptyHttp))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct EmptyHttp;

impl Context for EmptyHttp {}

impl HttpContext for EmptyHttp {}
