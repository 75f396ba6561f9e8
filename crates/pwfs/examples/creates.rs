//! Profiling aid: N threads of create + stat + unlink in private directories on a
//! MemDevice (the engine alone), ops/s. `cargo run --release --example creates -- 2 3 [IMAGE]`.
//! With `BY_INO=1` in the environment: by inode number (mknod, getattr, unlink in the
//! directory), no path walk and no file handle, so the metadata lock's part shows more.
use pwfs::device::mem::MemDevice;
use pwfs::{Config, Fs, MkfsOptions};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let secs: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(3.0);
    // A third argument: an image file to make and mount (the device `pwfs bench scale`
    // uses) instead of memory.
    let fs = match args.next() {
        Some(image) => {
            pwfs::mkfs_image(image.as_ref(), 1 << 30, &MkfsOptions::default()).unwrap();
            pwfs::mount_image(image.as_ref(), Config { cache_bytes: 256 << 20, ..Default::default() }).unwrap()
        }
        None => {
            let dev = Arc::new(MemDevice::new(256 << 20));
            pwfs::mkfs(&*dev, &MkfsOptions::default()).unwrap();
            Fs::mount(dev, Config { cache_bytes: 256 << 20, ..Default::default() }).unwrap()
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let total = Arc::new(AtomicU64::new(0));
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (fs, stop, total) = (fs.clone(), stop.clone(), total.clone());
            fs.create_dir(format!("/d{t}"), 0o755).unwrap();
            std::thread::spawn(move || {
                let mut i = 0u64;
                let by_ino = std::env::var_os("BY_INO").is_some();
                let dir = fs.resolve(format!("/d{t}"), true).unwrap();
                let who = pwfs::Creator::default();
                while !stop.load(Ordering::Relaxed) {
                    if by_ino {
                        let name = format!("f{i}");
                        let md = fs.mknod(dir, name.as_bytes(), 0o100644, 0, &who).unwrap();
                        fs.getattr(md.ino).unwrap();
                        fs.unlink(dir, name.as_bytes()).unwrap();
                    } else {
                        let p = format!("/d{t}/f{i}");
                        drop(fs.create(&p).unwrap());
                        fs.metadata(&p).unwrap();
                        fs.remove_file(&p).unwrap();
                    }
                    i += 1;
                }
                total.fetch_add(i, Ordering::Relaxed);
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_secs_f64(secs));
    stop.store(true, Ordering::Relaxed);
    hs.into_iter().for_each(|h| h.join().unwrap());
    println!("{threads} threads: {:.0} ops/s", total.load(Ordering::Relaxed) as f64 / secs);
}
