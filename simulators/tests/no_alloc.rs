//! Stepping never allocates: a counting global allocator watches `step` on every simulator of
//! this crate's classic, RiverSwim and Control Suite families.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use fedrl_sim::{Action, Space};

struct Counting;

thread_local! {
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> usize {
    ALLOCS.with(|c| c.get())
}

#[test]
fn step_and_reset_do_not_allocate() {
    let ids = [
        "CartPole-v1",
        "Acrobot-v1",
        "Pendulum-v1",
        "MountainCar-v0",
        "RiverSwim-v0",
        "cartpole-balance",
        "cartpole-swingup",
    ];
    for id in ids {
        let mut env = fedrl_sim::make(id).unwrap();
        let mut obs = vec![0f32; env.observation_space().dim()];
        let continuous = matches!(env.action_space(), Space::Box { .. });
        let n = match env.action_space() {
            Space::Discrete { n } => *n,
            Space::Box { .. } => 1,
        };
        let mut u = [0f32; 1];
        let before = allocations();
        env.reset(3, &mut obs);
        for t in 0..2000usize {
            let action = if continuous {
                u[0] = ((t % 7) as f32 - 3.0) * 0.9;
                Action::Continuous(&u)
            } else {
                Action::Discrete(t % n)
            };
            let s = env.step(action, &mut obs).unwrap();
            if s.terminated || s.truncated {
                env.reset(t as u64, &mut obs);
            }
        }
        assert_eq!(allocations() - before, 0, "{id} allocated while stepping");
    }
}
