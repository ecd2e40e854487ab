//! A safetensors file's header (`convert --hf`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = smoe_pipeline::parsers::safetensors(data);
});
