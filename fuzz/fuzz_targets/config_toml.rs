//! A `serve` config file (`smoe.toml`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = smoe_pipeline::parsers::config_toml(data);
});
