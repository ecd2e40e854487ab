//! An HTTP request body of `/v1/chat/completions` or `/v1/completions` (the first byte
//! picks the endpoint).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Some((&which, body)) = data.split_first() {
        let _ = smoe_pipeline::parsers::request_body(body, which & 1 == 1);
    }
});
