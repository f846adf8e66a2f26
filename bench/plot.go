package bench

import (
	"fmt"
	"image/color"
	"math"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// WritePlot draws bandwidth (GB/s) against block size (log scale) with one
// solid line per kvxfer transport (its best configuration at each size), one
// dashed line per peer series and a dotted memcpy line (both axes
// logarithmic), and saves it to path;
// the extension picks the format (.png, .svg, .pdf).
func WritePlot(r *Report, path string) error {
	ext := strings.ToLower(filepath.Ext(path))
	switch ext {
	case ".png", ".svg", ".pdf", ".jpg", ".jpeg":
	default:
		return fmt.Errorf("bench: plot file %q: want a .png or .svg name", path)
	}
	p := plot.New()
	p.Title.Text = "kvxfer bench: bandwidth vs block size"
	if r.Method.CPUModel != "" {
		p.Title.Text += fmt.Sprintf("\n%s, %d CPUs, %s", strings.TrimSpace(r.Method.CPUModel), r.Method.GOMAXPROCS, r.Method.Date)
	}
	p.X.Label.Text = "block size (bytes per WriteRequest)"
	p.Y.Label.Text = "GB/s (1e9 bytes/s)"
	p.X.Scale = plot.LogScale{}
	p.Y.Scale = plot.LogScale{}
	p.Legend.Top = true
	p.Legend.Left = true
	p.Add(plotter.NewGrid())

	var sizes []uint64
	seen := map[uint64]bool{}
	idx := 0
	var series []plotter.XYs
	addLine := func(name string, pts plotter.XYs, dashes []vg.Length) error {
		if len(pts) == 0 {
			return nil
		}
		sort.Slice(pts, func(i, j int) bool { return pts[i].X < pts[j].X })
		series = append(series, pts)
		l, s, err := plotter.NewLinePoints(pts)
		if err != nil {
			return fmt.Errorf("bench: plot %s: %w", name, err)
		}
		c := palette[idx%len(palette)]
		l.Color, s.Color = c, c
		l.Width = vg.Points(1.8)
		l.Dashes = dashes
		s.Shape = shapes[idx%len(shapes)]
		s.Radius = vg.Points(3)
		idx++
		p.Add(l, s)
		p.Legend.Add(name, l, s)
		for _, pt := range pts {
			if b := uint64(pt.X); !seen[b] {
				seen[b] = true
				sizes = append(sizes, b)
			}
		}
		return nil
	}
	best := r.Best()
	var memcpy plotter.XYs
	for _, t := range r.Method.Config.Transports {
		var pts plotter.XYs
		for b, res := range best[t] {
			if res.GBps.Median > 0 {
				pts = append(pts, plotter.XY{X: float64(b), Y: res.GBps.Median})
			}
			if t == "shm" && res.MemcpyGBps.Median > 0 {
				memcpy = append(memcpy, plotter.XY{X: float64(b), Y: res.MemcpyGBps.Median})
			}
		}
		if err := addLine("kvxfer "+t, pts, nil); err != nil {
			return err
		}
	}
	for _, t := range r.Method.Config.Transports {
		for _, l := range r.PeerLabels(t) {
			var pts plotter.XYs
			for _, pr := range r.Peers {
				if pr.Err == "" && pr.Label() == l && pr.GBps > 0 {
					pts = append(pts, plotter.XY{X: float64(pr.BlockBytes), Y: pr.GBps})
				}
			}
			if err := addLine(shortPeer(l)+" (peer)", pts, []vg.Length{vg.Points(6), vg.Points(3)}); err != nil {
				return err
			}
		}
	}
	if err := addLine("memcpy, 1 goroutine (shm working set)", memcpy, []vg.Length{vg.Points(2), vg.Points(2)}); err != nil {
		return err
	}
	if len(sizes) == 0 {
		return fmt.Errorf("bench: plot %s: no successful result to draw", path)
	}
	sort.Slice(sizes, func(i, j int) bool { return sizes[i] < sizes[j] })
	var ticks []plot.Tick
	for _, s := range sizes {
		ticks = append(ticks, plot.Tick{Value: float64(s), Label: FormatSize(s)})
	}
	p.X.Tick.Marker = plot.ConstantTicks(ticks)
	p.X.Min = float64(sizes[0]) / 1.5
	p.X.Max = float64(sizes[len(sizes)-1]) * 1.5
	// Log Y: decades of ticks, headroom above the data for the legend.
	lo, hi := math.Inf(1), 0.0
	for _, s := range series {
		for _, pt := range s {
			lo, hi = math.Min(lo, pt.Y), math.Max(hi, pt.Y)
		}
	}
	p.Y.Min = math.Pow(10, math.Floor(math.Log10(lo)))
	p.Y.Max = math.Pow(10, math.Ceil(math.Log10(hi))+0.6)
	var yt []plot.Tick
	for v := p.Y.Min; v <= p.Y.Max*1.0001; v *= 10 {
		yt = append(yt, plot.Tick{Value: v, Label: strconv.FormatFloat(v, 'g', -1, 64)})
		for m := 2.0; m < 10; m++ {
			if v*m <= p.Y.Max {
				yt = append(yt, plot.Tick{Value: v * m})
			}
		}
	}
	p.Y.Tick.Marker = plot.ConstantTicks(yt)
	if err := p.Save(9*vg.Inch, 6*vg.Inch, path); err != nil {
		return fmt.Errorf("bench: save plot %s: %w", path, err)
	}
	return nil
}

var palette = []color.Color{
	color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
	color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
	color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
	color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
	color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 0xff},
	color.RGBA{R: 0x8c, G: 0x56, B: 0x4b, A: 0xff},
	color.RGBA{R: 0x7f, G: 0x7f, B: 0x7f, A: 0xff},
	color.RGBA{R: 0x17, G: 0xbe, B: 0xcf, A: 0xff},
}

var shapes = []draw.GlyphDrawer{
	draw.CircleGlyph{}, draw.SquareGlyph{}, draw.TriangleGlyph{}, draw.CrossGlyph{},
	draw.PlusGlyph{}, draw.RingGlyph{}, draw.BoxGlyph{}, draw.PyramidGlyph{},
}
