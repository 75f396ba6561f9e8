#![allow(dead_code)]
//! Helpers shared by the integration tests.

use pwfs::device::mem::MemDevice;
use pwfs::device::sim::{SimConfig, SimDevice};
use pwfs::device::Device;
use pwfs::{Config, Fs, MkfsOptions};
use std::sync::Arc;

pub const MIB: u64 = 1 << 20;

/// A config for tests: small cache, no background thread (commits are explicit).
pub fn test_config() -> Config {
    Config { cache_bytes: 4 * MIB, writeback_interval: None, ..Default::default() }
}

pub fn mem_fs(size: u64) -> (Arc<MemDevice>, Fs) {
    let dev = Arc::new(MemDevice::new(size));
    pwfs::mkfs(&*dev, &MkfsOptions::default()).unwrap();
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    (dev, fs)
}

pub fn formatted_image(size: u64, opts: &MkfsOptions) -> Vec<u8> {
    let dev = MemDevice::new(size);
    pwfs::mkfs(&dev, opts).unwrap();
    dev.snapshot()
}

pub fn sim_fs(image: Vec<u8>, cfg: SimConfig, config: Config) -> (Arc<SimDevice>, Fs) {
    let dev = Arc::new(SimDevice::new(image, cfg));
    let fs = Fs::mount(dev.clone(), config).unwrap();
    (dev, fs)
}

pub fn fsck_clean(dev: &dyn Device) {
    let r = pwfs::fsck::check(dev).unwrap();
    assert!(r.is_clean(), "fsck found errors:\n{}", r.errors.join("\n"));
}

pub fn errno<T: std::fmt::Debug>(r: pwfs::Result<T>) -> i32 {
    r.expect_err("expected an error").errno()
}
