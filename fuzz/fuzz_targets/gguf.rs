//! A GGUF file (`convert --gguf`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = smoe_pipeline::parsers::gguf(data);
});
