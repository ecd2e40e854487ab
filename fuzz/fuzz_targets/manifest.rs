//! A vault's `manifest.json`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = smoe_pipeline::parsers::manifest(data);
});
