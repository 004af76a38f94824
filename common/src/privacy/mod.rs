//! The privacy core: what ran ([`event::DpEvent`]), how it is accounted (RDP, PLD, analytic
//! Gaussian), clipping, noise and the append-only ledger. No candle, no tokio.

pub mod event;
