//! Helpers shared by the Vulkan tests: opening the device the tests run on.
#![allow(dead_code)]

use std::sync::Arc;

use smoe_actors::vulkan::VulkanContext;

/// The device for tests: `SMOE_VULKAN_DEVICE` (default 0). Without a Vulkan driver the
/// test is skipped with a message, except under CI (`CI` set), where it fails.
pub fn context() -> Option<Arc<VulkanContext>> {
    let index = std::env::var("SMOE_VULKAN_DEVICE").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    match VulkanContext::new(index) {
        Ok(c) => Some(c),
        Err(e) if std::env::var_os("CI").is_none() => {
            eprintln!("skipping: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}
