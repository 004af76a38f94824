//! MuJoCo's primal Newton constraint solver (`mj_solNewton` with its line search `CGsearch`, and
//! the warm start of `mj_fwdConstraint`), written for a two-DOF tree with one scalar inequality
//! constraint: the slider limit of [`crate::dmc_cartpole`].
//!
//! Why by hand, and why so literally: MuJoCo minimises the constraint cost iteratively and stops
//! once a step would improve the scaled cost by less than its tolerance (1e-8). Near the optimum
//! the cost is flat in the pole's direction (its inertia is small), so the stopping point can sit
//! a few 1e-4 rad/s^2 away from the exact minimiser, and where it stops depends on the starting
//! point (the previous step's acceleration) and on every line-search step. The closed-form minimiser
//! therefore differs from MuJoCo by up to 1.2e-6 in one step's state at the rail; following the
//! same iterations from the same warm start reproduces MuJoCo to rounding (with one stopping
//! rule inferred from the traces, see [`LimitProblem::solve`]). No crate implements
//! this; linking MuJoCo itself would bring a C toolchain dependency for one constraint.
//!
//! Default `mjOption` values (`cartpole.xml` sets none of them): Newton solver, 100 iterations,
//! tolerance 1e-8, 50 line-search iterations, line-search tolerance 0.01, dense Jacobian.

/// MuJoCo's `mjMINVAL`.
const MINVAL: f64 = 1e-15;
/// `mjOption.tolerance`.
const TOLERANCE: f64 = 1e-8;
/// `mjOption.ls_tolerance`.
const LS_TOLERANCE: f64 = 0.01;
/// `mjOption.iterations`.
const ITERATIONS: usize = 100;
/// `mjOption.ls_iterations`.
const LS_ITERATIONS: usize = 50;

/// One constrained acceleration problem: minimise over `qacc`
/// `0.5 (qacc - qacc_smooth)' M (qacc - qacc_smooth) + s(J qacc - aref)` with
/// `s(x) = 0.5 D x^2` for `x < 0` and 0 otherwise (an inequality such as a joint limit).
#[derive(Clone, Copy, Debug)]
pub struct LimitProblem {
    /// Symmetric positive-definite mass matrix (kg, kg m, kg m^2).
    pub mass: [[f64; 2]; 2],
    /// Smooth generalised force `qfrc_smooth` (N, N m): applied, passive and bias forces.
    pub qfrc_smooth: [f64; 2],
    /// Constraint Jacobian row.
    pub jac: [f64; 2],
    /// Reference acceleration of the constraint (`efc_aref`).
    pub aref: f64,
    /// Constraint stiffness in the cost, `1 / R` (`efc_D`).
    pub d: f64,
    /// MuJoCo's cost scale `1 / (meaninertia * nv)`, i.e. one over the trace of the mass
    /// matrix at `qpos0` (the same at every pose for a cart-pole).
    pub scale: f64,
}

/// The state of the solver along one search line (MuJoCo's `mjCGPnt`).
#[derive(Clone, Copy, Debug)]
struct Pnt {
    alpha: f64,
    cost: f64,
    d0: f64,
    d1: f64,
}

/// Quantities the line search works with at the current iterate.
struct Line {
    /// Gauss cost polynomial in alpha: constant, linear, quadratic coefficients.
    gauss: [f64; 3],
    /// Constraint cost polynomial while the constraint is active.
    quad: [f64; 3],
    jaref: f64,
    jv: f64,
    evals: usize,
}

impl Line {
    fn eval(&mut self, alpha: f64) -> Pnt {
        let mut q = self.gauss;
        if self.jaref + alpha * self.jv < 0.0 {
            for (t, c) in q.iter_mut().zip(self.quad) {
                *t += c;
            }
        }
        let cost = alpha * alpha * q[2] + alpha * q[1] + q[0];
        let d0 = 2.0 * alpha * q[2] + q[1];
        let mut d1 = 2.0 * q[2];
        if d1 <= 0.0 {
            d1 = MINVAL;
        }
        self.evals += 1;
        Pnt {
            alpha,
            cost,
            d0,
            d1,
        }
    }
}

fn dot(a: [f64; 2], b: [f64; 2]) -> f64 {
    a[0] * b[0] + a[1] * b[1]
}

fn mul(m: [[f64; 2]; 2], v: [f64; 2]) -> [f64; 2] {
    [dot(m[0], v), dot(m[1], v)]
}

/// Solves `h x = g` for a symmetric positive-definite 2x2 `h` by Cholesky, as `mju_cholSolve`.
fn chol_solve(h: [[f64; 2]; 2], g: [f64; 2]) -> [f64; 2] {
    let l00 = h[0][0].max(MINVAL).sqrt();
    let l10 = h[1][0] / l00;
    let l11 = (h[1][1] - l10 * l10).max(MINVAL).sqrt();
    let y0 = g[0] / l00;
    let y1 = (g[1] - l10 * y0) / l11;
    let x1 = y1 / l11;
    let x0 = (y0 - l10 * x1) / l00;
    [x0, x1]
}

impl LimitProblem {
    /// The unconstrained acceleration `M^-1 qfrc_smooth`.
    pub fn qacc_smooth(&self) -> [f64; 2] {
        let [[a, b], [_, c]] = self.mass;
        let det = a * c - b * b;
        let [f0, f1] = self.qfrc_smooth;
        [(c * f0 - b * f1) / det, (a * f1 - b * f0) / det]
    }

    fn constraint_cost(&self, jar: f64) -> f64 {
        if jar < 0.0 {
            0.5 * self.d * jar * jar
        } else {
            0.0
        }
    }

    /// Gauss cost `0.5 (M qacc - qfrc_smooth)' (qacc - qacc_smooth)` with `ma = M qacc`.
    fn gauss(&self, qacc: [f64; 2], ma: [f64; 2], smooth: [f64; 2]) -> f64 {
        let f = self.qfrc_smooth;
        0.5 * ((ma[0] - f[0]) * (qacc[0] - smooth[0]) + (ma[1] - f[1]) * (qacc[1] - smooth[1]))
    }

    /// Total cost at `qacc` (MuJoCo's `CGupdateConstraint`), with `ma = M qacc` and
    /// `jaref = J qacc - aref` given.
    fn cost(&self, qacc: [f64; 2], ma: [f64; 2], jaref: f64, smooth: [f64; 2]) -> f64 {
        self.constraint_cost(jaref) + self.gauss(qacc, ma, smooth)
    }

    /// Gradient of the cost and the Newton direction's `H^-1 grad` at an iterate.
    fn gradient(&self, ma: [f64; 2], jaref: f64) -> ([f64; 2], [f64; 2]) {
        let active = jaref < 0.0;
        let force = if active { -self.d * jaref } else { 0.0 };
        let f = self.qfrc_smooth;
        let grad = [
            ma[0] - f[0] - self.jac[0] * force,
            ma[1] - f[1] - self.jac[1] * force,
        ];
        let dd = if active { self.d } else { 0.0 };
        let mut h = self.mass;
        for (r, row) in h.iter_mut().enumerate() {
            for (c, v) in row.iter_mut().enumerate() {
                *v += self.jac[r] * dd * self.jac[c];
            }
        }
        (grad, chol_solve(h, grad))
    }

    /// MuJoCo's choice of starting point: the warm start (the previous step's acceleration)
    /// unless `qacc_smooth` costs less.
    fn start(&self, warm: [f64; 2], smooth: [f64; 2]) -> [f64; 2] {
        let jar_warm = dot(self.jac, warm) - self.aref;
        let cost_warm = self.cost(warm, mul(self.mass, warm), jar_warm, smooth);
        let cost_smooth = self.constraint_cost(dot(self.jac, smooth) - self.aref);
        if cost_warm > cost_smooth {
            smooth
        } else {
            warm
        }
    }

    /// MuJoCo's line search along `search` from the iterate (`CGsearch`): returns the step
    /// length, 0 when no improvement is possible.
    fn line_search(&self, search: [f64; 2], ma: [f64; 2], jaref: f64, gauss_cost: f64) -> f64 {
        let snorm = dot(search, search).sqrt();
        if snorm < MINVAL {
            return 0.0;
        }
        let gtol = TOLERANCE * LS_TOLERANCE * snorm / self.scale;
        let mv = mul(self.mass, search);
        let jv = dot(self.jac, search);
        let djaref = self.d * jaref;
        let mut line = Line {
            gauss: [
                gauss_cost,
                dot(search, ma) - dot(self.qfrc_smooth, search),
                0.5 * dot(search, mv),
            ],
            quad: [0.5 * jaref * djaref, jv * djaref, 0.5 * jv * self.d * jv],
            jaref,
            jv,
            evals: 0,
        };
        let p0 = line.eval(0.0);
        let mut p1 = line.eval(p0.alpha - p0.d0 / p0.d1);
        if p0.cost < p1.cost {
            p1 = p0;
        }
        if p1.d0.abs() < gtol {
            return p1.alpha;
        }
        let dir = if p1.d0 < 0.0 { 1.0 } else { -1.0 };
        let mut p2 = p1;
        let mut p2update = false;
        while p1.d0 * dir <= -gtol && line.evals < LS_ITERATIONS {
            p2 = p1;
            p2update = true;
            p1 = line.eval(p1.alpha - p1.d0 / p1.d1);
            if p1.d0.abs() < gtol {
                return p1.alpha;
            }
        }
        if line.evals >= LS_ITERATIONS || !p2update {
            return p1.alpha;
        }
        let mut p2next = p1;
        let mut p1next = line.eval(p1.alpha - p1.d0 / p1.d1);
        while line.evals < LS_ITERATIONS {
            let pmid = line.eval(0.5 * (p1.alpha + p2.alpha));
            let candidates = [p1next, p2next, pmid];
            let mut best: Option<Pnt> = None;
            for c in candidates {
                if c.d0.abs() < gtol && best.is_none_or(|b| c.cost < b.cost) {
                    best = Some(c);
                }
            }
            if let Some(b) = best {
                return b.alpha;
            }
            let b1 = update_bracket(&mut line, &mut p1, &candidates, &mut p1next);
            let b2 = update_bracket(&mut line, &mut p2, &candidates, &mut p2next);
            if !b1 && !b2 {
                return pmid.alpha;
            }
        }
        if p1.cost <= p2.cost && p1.cost < p0.cost {
            p1.alpha
        } else if p2.cost <= p1.cost && p2.cost < p0.cost {
            p2.alpha
        } else {
            0.0
        }
    }

    /// The constrained acceleration MuJoCo's Newton solver returns from warm start `warm`
    /// (the previous step's final acceleration; zeros after a reset).
    pub fn solve(&self, warm: [f64; 2]) -> [f64; 2] {
        let smooth = self.qacc_smooth();
        let mut qacc = self.start(warm, smooth);
        let mut ma = mul(self.mass, qacc);
        let mut jaref = dot(self.jac, qacc) - self.aref;
        let mut cost = self.cost(qacc, ma, jaref, smooth);
        let (_, mut mgrad) = self.gradient(ma, jaref);
        let mut search = [-mgrad[0], -mgrad[1]];
        for _ in 0..ITERATIONS {
            let gauss = self.gauss(qacc, ma, smooth);
            let alpha = self.line_search(search, ma, jaref, gauss);
            if alpha == 0.0 {
                break;
            }
            let mv = mul(self.mass, search);
            let jv = dot(self.jac, search);
            for i in 0..2 {
                qacc[i] += alpha * search[i];
                ma[i] += alpha * mv[i];
            }
            jaref += alpha * jv;
            let old = cost;
            cost = self.cost(qacc, ma, jaref, smooth);
            let (grad, mg) = self.gradient(ma, jaref);
            mgrad = mg;
            let improvement = self.scale * (old - cost);
            let gradient = self.scale * dot(grad, grad).sqrt();
            // The scaled decrease the next Newton step would bring (exact while the constraint
            // keeps its state). Not in the MuJoCo source we read, but the dm_control traces
            // (MuJoCo 3.17.0) need it: at seed 1002 step 194 MuJoCo keeps the first iterate,
            // whose pole acceleration is 3.5e-4 rad/s^2 off, where the next step would gain
            // 1.8e-9; it takes the second step wherever that would gain 4e-7 or more.
            let predicted = 0.5 * self.scale * dot(grad, mgrad);
            if improvement < TOLERANCE || gradient < TOLERANCE || predicted < TOLERANCE {
                break;
            }
            search = [-mgrad[0], -mgrad[1]];
        }
        qacc
    }
}

/// MuJoCo's `updateBracket`: moves a bracket end to a candidate with a smaller derivative of the
/// same sign, and evaluates the Newton point from it.
fn update_bracket(line: &mut Line, p: &mut Pnt, candidates: &[Pnt; 3], next: &mut Pnt) -> bool {
    let mut moved = false;
    for c in candidates {
        if (p.d0 < 0.0 && c.d0 < 0.0 && p.d0 < c.d0) || (p.d0 > 0.0 && c.d0 > 0.0 && p.d0 > c.d0) {
            *p = *c;
            moved = true;
        }
    }
    if moved {
        *next = line.eval(p.alpha - p.d0 / p.d1);
    }
    moved
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(aref: f64) -> LimitProblem {
        LimitProblem {
            mass: [[1.1, 0.04], [0.04, 0.034]],
            qfrc_smooth: [3.0, 0.2],
            jac: [-1.0, 0.0],
            aref,
            d: 50.0,
            scale: 1.0 / 1.134,
        }
    }

    /// The closed-form minimiser of the same cost, for comparison.
    fn exact(p: &LimitProblem) -> [f64; 2] {
        let a0 = p.qacc_smooth();
        let jar = dot(p.jac, a0) - p.aref;
        if jar >= 0.0 {
            return a0;
        }
        let [[a, b], [_, c]] = p.mass;
        let det = a * c - b * b;
        let minv = [[c / det, -b / det], [-b / det, a / det]];
        let mj = mul(minv, p.jac);
        let force = (p.aref - dot(p.jac, a0)) / (dot(p.jac, mj) + 1.0 / p.d);
        [a0[0] + mj[0] * force, a0[1] + mj[1] * force]
    }

    #[test]
    fn inactive_constraint_gives_the_smooth_acceleration() {
        let p = problem(-100.0);
        let a = p.solve([0.0, 0.0]);
        let s = p.qacc_smooth();
        assert!(
            (a[0] - s[0]).abs() < 1e-12 && (a[1] - s[1]).abs() < 1e-12,
            "{a:?} {s:?}"
        );
    }

    #[test]
    fn active_constraint_reaches_the_minimiser_to_the_solver_tolerance() {
        for aref in [10.0, 100.0, 1000.0] {
            let p = problem(aref);
            let want = exact(&p);
            for warm in [[0.0, 0.0], want, [-5.0, 3.0], [20.0, -40.0]] {
                let got = p.solve(warm);
                // The cost near the optimum is 0.5 e' H e; the solver stops when it improves by
                // less than 1e-8 / scale, so e is at most a few 1e-4 in the cheap direction.
                for i in 0..2 {
                    assert!(
                        (got[i] - want[i]).abs() < 1e-3,
                        "aref {aref} warm {warm:?}: {got:?} vs {want:?}"
                    );
                }
                let cost = |q: [f64; 2]| {
                    p.cost(q, mul(p.mass, q), dot(p.jac, q) - p.aref, p.qacc_smooth())
                };
                assert!(cost(got) >= cost(want) * (1.0 - 1e-12) - 1e-12);
                assert!(p.scale * (cost(got) - cost(want)) < 1e-8);
            }
        }
    }
}
