// A small line chart on a canvas (pagellm's own, no library): series of [t, y] points over the
// last `windowS` seconds, each series its own color, the y axis from 0 to the largest value.
"use strict";
window.LineChart = class LineChart {
  constructor(canvas, windowS, colors) {
    this.canvas = canvas;
    this.ctx = canvas.getContext("2d");
    this.windowS = windowS;
    this.colors = colors;
  }
  draw(seriesList, now, labels) {
    const { ctx, canvas } = this;
    const w = canvas.width, h = canvas.height, pad = 28;
    ctx.clearRect(0, 0, w, h);
    let top = 0;
    for (const s of seriesList) for (const [, y] of s) top = Math.max(top, y);
    top = top > 0 ? top * 1.1 : 1;
    ctx.strokeStyle = "#eceef2";
    ctx.fillStyle = "#7a8394";
    ctx.font = "10px sans-serif";
    for (let i = 0; i <= 4; i++) {
      const y = h - pad + ((pad * 2 - h) * i) / 4;
      ctx.beginPath(); ctx.moveTo(pad, y); ctx.lineTo(w - 6, y); ctx.stroke();
      ctx.fillText(((top * i) / 4).toFixed(top >= 10 ? 0 : 1), 2, y + 3);
    }
    seriesList.forEach((s, k) => {
      ctx.strokeStyle = this.colors[k % this.colors.length];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let first = true;
      for (const [t, y] of s) {
        const x = pad + ((w - pad - 6) * (t - (now - this.windowS))) / this.windowS;
        const yy = h - pad - ((h - pad * 2) * y) / top;
        if (x < pad) continue;
        if (first) { ctx.moveTo(x, yy); first = false; } else ctx.lineTo(x, yy);
      }
      ctx.stroke();
      if (labels && labels[k]) { ctx.fillStyle = ctx.strokeStyle; ctx.fillText(labels[k], w - 90, 12 + 12 * k); }
    });
  }
};
