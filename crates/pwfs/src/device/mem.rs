//! In-memory engine: loads and stores on a [`MemoryMedium`], done inside `start` (a
//! handle is finished when it is returned). Flush and FUA writes `persist`, which on
//! heap memory does nothing: nothing survives the process.

use super::{validate, DevError, Device, MemoryMedium, Op, OpKind, Pending};

pub struct MemDevice {
    medium: MemoryMedium,
}

impl MemDevice {
    pub fn new(len: u64) -> MemDevice {
        MemDevice::on(MemoryMedium::new(vec![0; len as usize]))
    }
    pub fn from_vec(data: Vec<u8>) -> MemDevice {
        MemDevice::on(MemoryMedium::new(data))
    }
    pub fn on(medium: MemoryMedium) -> MemDevice {
        MemDevice { medium }
    }
    pub fn snapshot(&self) -> Vec<u8> {
        self.medium.snapshot()
    }

    fn run(&self, op: &mut Op) -> Result<(), DevError> {
        validate(op, self.medium.len())?;
        match op.kind {
            OpKind::Read => self.medium.load(op),
            OpKind::Write => self.medium.store(op),
            OpKind::WriteFua => {
                self.medium.store(op);
                self.medium.persist(op.offset, op.len());
            }
            OpKind::Flush => self.medium.persist(0, self.medium.len()),
        }
        Ok(())
    }
}

impl Device for MemDevice {
    fn len(&self) -> u64 {
        self.medium.len()
    }

    fn start(&self, ops: Vec<Op>) -> Pending {
        Pending::run_each(ops, |op| self.run(op))
    }

    fn name(&self) -> &'static str {
        "mem"
    }
}
